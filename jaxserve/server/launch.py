"""Running the app under uvicorn: in the foreground (``jaxserve serve``) or in a thread (tests, notebooks)."""

from __future__ import annotations

import signal
import socket
import threading
import time

import uvicorn


class GracefulServer(uvicorn.Server):
    """uvicorn's server, which on SIGTERM (or Ctrl-C) stops accepting connections and admitting requests (503),
    lets in-flight requests finish for ``grace`` seconds, aborts those still running (their streams end with
    ``finish_reason: "abort"``), and exits 0 instead of re-raising the signal."""

    def __init__(self, config: uvicorn.Config, engine, grace: float):
        super().__init__(config)
        self._engine, self._grace = engine, grace

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            self._engine.begin_drain(self._grace)
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM:  # a requested shutdown that completes is a success
            self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]


def make_server(app, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info",
                shutdown_timeout: float = 30.0) -> GracefulServer:
    # uvicorn's own deadline comes a little after ours, so aborted streams can still send their last event.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=30,
                            timeout_graceful_shutdown=shutdown_timeout + 5)
    return GracefulServer(config, app.state.server.engine, shutdown_timeout)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """The app served from a background thread (no signal handling there); ``stop()`` shuts it down gracefully.

    Example::

        with ServerThread(build_app(engine)) as srv:
            openai.OpenAI(base_url=srv.url + "/v1", api_key="x")...
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None, log_level: str = "warning",
                 shutdown_timeout: float = 5.0):
        self.host, self.port = host, port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.server = make_server(app, host, self.port, log_level=log_level, shutdown_timeout=shutdown_timeout)
        self._thread = threading.Thread(target=self.server.run, name="jaxserve-http", daemon=True)

    def start(self, timeout: float = 60.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """What SIGTERM does to ``jaxserve serve``."""
        self.server.handle_exit(signal.SIGTERM, None)
        self._thread.join(timeout)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
