"""The Batch API's errors, each with its HTTP status and OpenAI's error JSON (`.body()`).

They are VsupErrors too: one line a user can act on, never a traceback.
"""

from __future__ import annotations

from vsup.errors import VsupError


class BatchError(VsupError):
    """An error the routes answer with `status` and `body()`."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": "invalid_request_error", "param": self.param, "code": self.code}}


class NotFound(BatchError):
    """404: missing, or another owner's (worded the same: no existence oracle)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(404, message, None, param)


class BadInput(BatchError):
    """400: a value the request may not have; the message says what works."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(400, message, code, param)


class Conflict(BatchError):
    """409: the object's state forbids it (cancel a finished batch, delete a file a running batch reads)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(409, message, None, param)


class TooLarge(BatchError):
    """413: a file over `batch.max_file_bytes`, or the store over `batch.max_total_bytes`."""

    def __init__(self, key: str, limit: int, what: str | None = None):
        self.key = key
        self.limit = limit
        if key == "batch.max_file_bytes":
            text = f"{what or 'the file'} is larger than batch.max_file_bytes ({limit} bytes); split it into smaller files"
            code = "file_too_large"
        else:
            text = (f"{what or 'this'} would take the batch store over batch.max_total_bytes ({limit} bytes); "
                    "delete files or finished batches' results, or wait for them to pass batch.retention")
            code = "storage_limit_exceeded"
        super().__init__(413, text, code, None)
