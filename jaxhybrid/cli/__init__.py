"""The ``jaxhybrid`` command line: :mod:`.main` dispatches to :mod:`.commands`; :mod:`.launch` holds the
launcher's helpers."""
