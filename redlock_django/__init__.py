"""Redlock distributed locks for Django."""

__version__ = "0.1.0"
