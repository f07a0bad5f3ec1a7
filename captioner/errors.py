"""The one exception type for mistakes a user can fix (bad files, wrong flags, missing data).

Entry points catch it and print its message instead of a traceback; everything else is a bug
and keeps its traceback.
"""


class CaptionerError(Exception):
    """A problem with the user's input, explained in the message (which names the file/field)."""


class ImageError(CaptionerError):
    """An image that cannot be read or is not acceptable (empty, truncated, too large, ...)."""
