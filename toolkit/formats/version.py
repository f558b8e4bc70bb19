"""The package version and the schema version every sparsecal file carries."""

__version__ = "0.2.0"
SCHEMA_VERSION = 1
