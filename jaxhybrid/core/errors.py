"""The errors jaxhybrid raises for input it cannot run: the lowest layer, imported by every other."""


class ConfigError(ValueError):
    """A configuration the run cannot execute. The message names the values and the fix."""
