"""The package version, here so that the engine can record it without importing its parent package."""

__version__ = "0.1.0"
