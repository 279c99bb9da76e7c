"""Integrations with other frameworks, each an optional import of its own."""
