"""The one exception type users see: a one-line message naming the file, row, key or option."""


class GRPOError(Exception):
    """A user-facing error. The CLI prints `error: <message>` on one line and exits 1."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))
