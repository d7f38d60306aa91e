"""The distribution's version, in one place: pyproject.toml reads it, and every package re-exports it."""

__version__ = "0.1.0"
