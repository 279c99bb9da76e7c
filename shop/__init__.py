"""A sample Django project that uses redlock_django: the flash-sale shop."""
