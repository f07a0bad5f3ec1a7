"""The one exception type for mistakes a user can fix (bad files, wrong flags, missing data).

Entry points print its message instead of a traceback; everything else is a bug and keeps its traceback.
"""


class CaptionerError(Exception):
    """A problem with the user's input, explained in the message (which names the file/field)."""


class ImageError(CaptionerError):
    """An image that cannot be read or is not acceptable (empty, truncated, too large, ...)."""


class OptionError(CaptionerError, ValueError):
    """An option or setting with a value that cannot be used; the message names the option (--flag)."""
