"""The errors jaxhybrid raises for input it cannot run: the lowest layer, imported by every other."""
import errno


class ConfigError(ValueError):
    """A configuration the run cannot execute. The message names the values and the fix."""


class DiskFull(OSError):
    """A write that found its disk full (errno ENOSPC), in one line naming the folder, the bytes it needed
    and those free: the command line and a rank's failure report print it without a traceback."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return self.args[1]


def says_disk_full(text: str) -> bool:
    """Whether a message reports a full disk, as tensorstore words it (orbax passes it on without the errno)."""
    return "No space left on device" in text or "os_error_code='28'" in text


def is_disk_full(e: BaseException | None) -> bool:
    """Whether ``e`` or an error it was raised from reports a full disk: an OSError with errno ENOSPC, or
    :func:`says_disk_full` text."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or says_disk_full(str(e)):
            return True
        e = e.__cause__ or e.__context__
    return False
