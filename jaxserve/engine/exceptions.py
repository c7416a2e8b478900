"""The engine's exceptions: what a step or the engine's thread raises, and what the server answers for each."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxserve.core.outputs import RequestOutput


class StepFailed(RuntimeError):
    """Part of a step failed. ``request_ids`` (the requests it held) were aborted and their pages freed;
    ``outputs`` are the step's outputs of every other request, to deliver as usual; every other request
    goes on. The cause is ``__cause__``."""

    def __init__(self, request_ids: list[str], outputs: list[RequestOutput], cause: BaseException):
        super().__init__(f"requests {request_ids[:8]}{'...' if len(request_ids) > 8 else ''} failed: {cause!r}")
        self.request_ids, self.outputs, self.cause = request_ids, outputs, cause


class EngineDeadError(RuntimeError):
    """The engine thread failed; no request can be served (answered 503)."""


class EngineStepError(RuntimeError):
    """An engine step raised: the requests in that step failed (answered 500); the engine serves on."""


class ServerBusyError(RuntimeError):
    """Too many requests are waiting, or the server is shutting down (answered 503 with Retry-After)."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after
