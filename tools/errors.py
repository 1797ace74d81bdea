"""The one exception type the tools raise for input a user can fix."""
from __future__ import annotations

from typing import Optional


class ToolInputError(Exception):
    """Bad input to a tool: names the file (and line, where there is one) and says what to do.

    Entry points print ``str(error)`` and exit non-zero; library code only raises it.
    """

    def __init__(self, message: str, path: Optional[str] = None, line: Optional[int] = None):
        self.message = message
        self.path = path
        self.line = line
        where = ""
        if path is not None:
            where = f"{path}:{line}: " if line is not None else f"{path}: "
        super().__init__(f"{where}{message}")

    def __reduce__(self):
        # Keep the structured fields when the error crosses a multiprocessing boundary.
        return (type(self), (self.message, self.path, self.line))
