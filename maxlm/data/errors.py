"""The one exception for bad user data: it names the file (and line) so the user can fix it."""

from __future__ import annotations

from maxlm.runtime.errors import UserError


class DataError(UserError):
    """Bad input data or a data/config mismatch. `str(e)` is `FILE:LINE: what is wrong`.

    A `UserError`: a command ends on it with exit status 2 and one line, no traceback.
    """

    def __init__(self, message: str, file: str | None = None, line: int | None = None):
        self.file, self.line = file, line
        where = file if line is None else f"{file}:{line}"
        super().__init__(f"{where}: {message}" if file else message)
