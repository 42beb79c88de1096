"""The bottom layer: errors, the run config's schema and parsing, hardware files, parity helpers. Imports no
other jaxhybrid layer."""

__version__ = "0.1.0"
