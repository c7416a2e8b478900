"""Running the app under uvicorn: in the foreground (``jaxserve serve``) or in a thread (tests, notebooks)."""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from jaxserve.server import DEFAULT_HEADER_TIMEOUT


class _HeaderDeadline(H11Protocol):
    """uvicorn's h11 protocol with a deadline on the request head: from the moment a connection opens, or the first
    byte of a later request on it arrives, the client has ``header_timeout`` seconds to finish its request line and
    headers, however slowly it trickles them (uvicorn times out only idle keep-alive connections, and any byte
    resets that). Past it the connection gets 408 and is closed."""

    header_timeout = DEFAULT_HEADER_TIMEOUT
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._deadline = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head is complete (or the connection is done for)
            self._cancel_deadline()
        elif self._deadline is None:
            self._deadline = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def connection_lost(self, exc) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _headers_too_slow(self) -> None:
        self._deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            self.transport.close()


class GracefulServer(uvicorn.Server):
    """uvicorn's server, which on SIGTERM (or Ctrl-C) stops admitting requests, lets in-flight requests finish for
    ``grace`` seconds and aborts those still running (their streams end with ``finish_reason: "abort"``). While
    they drain it still accepts connections and answers them (new requests and ``/health``: 503), so load balancers
    and clients see the drain; once none is left it stops listening. The signal is not re-raised: ``exit_status``
    says how the process should end."""

    def __init__(self, config: uvicorn.Config, engine, grace: float):
        super().__init__(config)
        self._engine, self._grace = engine, grace
        self.stop_signal: int | None = None

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            self._engine.begin_drain(self._grace)
        super().handle_exit(sig, frame)
        if sig in (signal.SIGTERM, signal.SIGINT):
            self.stop_signal = self.stop_signal or sig
            # uvicorn would re-raise it once stopped, where asyncio's own SIGINT handler swallows it (exit 0)
            self._captured_signals = [s for s in self._captured_signals if s != sig]

    async def shutdown(self, sockets=None) -> None:
        # uvicorn closes the listening sockets and idle connections first: wait for the drain before that (a second
        # Ctrl-C, force_exit, cuts the wait short; the margin covers the aborted streams' last events)
        deadline = time.monotonic() + self._grace + 5
        while self._engine.num_in_flight and not self.force_exit and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await super().shutdown(sockets)

    @property
    def exit_status(self) -> int:
        """1 if the server never started; 130 (128 + SIGINT, what a shell reports for a Ctrl-C'd program) after
        SIGINT; 0 otherwise: a requested shutdown (SIGTERM) that completes is a success."""
        if not self.started:
            return 1
        return 128 + signal.SIGINT if self.stop_signal == signal.SIGINT else 0


def make_server(
    app,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    log_level: str = "info",
    shutdown_timeout: float = 30.0,
    header_timeout: float = DEFAULT_HEADER_TIMEOUT,
) -> GracefulServer:
    """The server for ``app`` (``header_timeout``: seconds a client may take to send a request's headers)."""
    protocol = type("H11HeaderDeadline", (_HeaderDeadline,), {"header_timeout": header_timeout})
    # uvicorn's own deadline comes a little after ours, so aborted streams can still send their last event.
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_keep_alive=30,
        timeout_graceful_shutdown=shutdown_timeout + 5,
        http=protocol,
    )
    return GracefulServer(config, app.state.server.engine, shutdown_timeout)


def serve(app, host: str = "127.0.0.1", port: int = 8000, **kw) -> int:
    """Serves ``app`` in the foreground until SIGTERM or SIGINT; returns the process's exit status."""
    server = make_server(app, host, port, **kw)
    server.run()
    return server.exit_status


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

    def __init__(
        self,
        app,
        host: str = "127.0.0.1",
        port: int | None = None,
        log_level: str = "warning",
        shutdown_timeout: float = 5.0,
        header_timeout: float = DEFAULT_HEADER_TIMEOUT,
    ):
        self.host, self.port = host, port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.server = make_server(
            app, host, self.port, log_level=log_level, shutdown_timeout=shutdown_timeout, header_timeout=header_timeout
        )
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
