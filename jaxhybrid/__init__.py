"""jaxhybrid."""
