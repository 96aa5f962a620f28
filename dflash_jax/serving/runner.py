"""Running the app under uvicorn: in the foreground (``serve.py``) or on a background thread (tests).

Slow and idle clients are bounded here, below the app (``guarded_protocol``): a connection must send
its request headers within ``header_timeout_s``, and at most ``max_connections`` are open. The body's
timeout is the app's (``create_app(body_timeout_s=...)``), which answers it 408.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import signal
import socket
import threading
import time
from typing import Any

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from dflash_jax.serving.protocol import error_body
from dflash_jax.serving.settings import ServerSettings

log = logging.getLogger("dflash_jax.serving")

_DEFAULTS = ServerSettings()

# uvicorn's own limit on graceful shutdown, past the app's (``graceful_shutdown_timeout_s``, when the
# app answers what is still running 503): a request the app could not end then (e.g. a stream whose
# client reads nothing) is cancelled.
_SHUTDOWN_BACKSTOP_S = 5.0


class _Connections:
    """The open connections of one server, oldest first, and the limits they share."""

    def __init__(self, header_timeout_s: float, max_connections: int):
        self.header_timeout_s = header_timeout_s
        self.max_connections = max_connections
        self.open: dict[Any, None] = {}  # insertion-ordered: the oldest first

    def make_room(self) -> bool:
        """At the limit, closes the oldest connection still sending a request; False if none is."""
        if len(self.open) < self.max_connections:
            return True
        for conn in self.open:
            if conn.sending_request:
                self.open.pop(conn)
                conn.transport.close()
                return True
        return False


def _refusal() -> bytes:
    body = json.dumps(error_body("the server has too many open connections; retry later", type="server_error",
                                 code="server_overloaded")).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))


def guarded_protocol(header_timeout_s: float, max_connections: int, base: type = AutoHTTPProtocol) -> type:
    """uvicorn's HTTP protocol class (``base``) with a header timeout and a connection limit.

    uvicorn closes idle keep-alive connections (``timeout_keep_alive``), but restarts that timer at
    every byte received and never starts it on a new connection: a client that opens a connection and
    sends nothing, or a header byte every few seconds, holds it (and a file descriptor) forever, and
    enough of them exhaust the process's descriptors, after which every request fails. Its
    ``limit_concurrency`` answers 503 only once a request's headers have arrived, so it bounds nothing
    against clients that never finish them.

    Here each connection has one deadline, ``header_timeout_s`` after it opened or after its previous
    response was sent, by which its next request's headers must have arrived (that is, the app has
    been called for it); bytes received do not move it. A connection past it is closed. The app being
    called is the protocol-independent sign that headers are complete: the class wraps the app it
    calls (``self.app``), so it works for uvicorn's h11 and httptools protocols alike.

    A connection is "sending a request" from its opening (or previous response) until its request's
    body has arrived whole (seen by wrapping the ASGI ``receive``; a request without a body: its
    headers). With ``max_connections`` open, a new connection closes the oldest one sending a
    request (so slow clients cannot crowd out others), or, when every open connection is being
    answered, is itself answered 503 and closed. Between a request's headers and the app's first
    step (one event-loop turn) a connection still counts as sending.
    """
    connections = _Connections(header_timeout_s, max_connections)

    class GuardedProtocol(base):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.sending_request = True
            self._deadline: asyncio.TimerHandle | None = None
            app = self.app

            async def guarded_app(scope: Any, receive: Any, send: Any) -> None:
                self._cancel_deadline()
                if not _has_body(scope):
                    self.sending_request = False
                    return await app(scope, receive, send)

                async def watched_receive() -> Any:
                    message = await receive()
                    if message["type"] != "http.request" or not message.get("more_body", False):
                        self.sending_request = False
                    return message

                return await app(scope, watched_receive, send)

            self.app = guarded_app

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if not connections.make_room():
                log.warning("refusing a connection: %d are open and none is waiting for its request",
                            len(connections.open))
                transport.write(_refusal())
                transport.close()
                return
            connections.open[self] = None
            self._start_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_deadline()
            connections.open.pop(self, None)
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self.sending_request = True
                self._start_deadline()

        def _start_deadline(self) -> None:
            self._cancel_deadline()
            self._deadline = self.loop.call_later(connections.header_timeout_s, self._deadline_passed)

        def _cancel_deadline(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _deadline_passed(self) -> None:
            self._deadline = None
            if self.sending_request and not self.transport.is_closing():
                self.transport.close()

    GuardedProtocol.__name__ = GuardedProtocol.__qualname__ = f"Guarded{base.__name__}"
    return GuardedProtocol


def _has_body(scope: Any) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() not in (b"", b"0")):
            return True
    return False


def uvicorn_config(app: Any, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                   timeout_graceful_shutdown: float | None = None,
                   header_timeout_s: float = _DEFAULTS.header_timeout_s,
                   max_connections: int = _DEFAULTS.max_connections) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        http=guarded_protocol(header_timeout_s, max_connections),
        timeout_graceful_shutdown=(None if timeout_graceful_shutdown is None
                                   else timeout_graceful_shutdown + _SHUTDOWN_BACKSTOP_S),
        # SSE responses are streamed as they are produced; keep-alive connections close on shutdown.
        access_log=log_level == "debug",
    )


class _Server(uvicorn.Server):
    """uvicorn's server that tells the app when shutdown starts and how long in-flight requests may
    still run (``app.state.shutdown_started(timeout_s)``, see ``create_app``)."""

    def __init__(self, config: uvicorn.Config, app: Any, timeout_graceful_shutdown: float | None):
        super().__init__(config)
        self._notify = getattr(getattr(app, "state", None), "shutdown_started", None)
        self._timeout = timeout_graceful_shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._notify is not None:
            self._notify(self._timeout)
        await super().shutdown(sockets)


def _server(app: Any, *, host: str, port: int, log_level: str, timeout_graceful_shutdown: float | None,
            header_timeout_s: float, max_connections: int) -> _Server:
    config = uvicorn_config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=timeout_graceful_shutdown, header_timeout_s=header_timeout_s,
                            max_connections=max_connections)
    return _Server(config, app, timeout_graceful_shutdown)


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` as uvicorn binds one (``SO_REUSEADDR``), not listening yet:
    ``serve.py`` binds it before the models load and compile, so that a port in use is an error at
    once rather than after the warm-up. Raises ``OSError``."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def run_server(app: Any, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
               timeout_graceful_shutdown: float | None = None, header_timeout_s: float = _DEFAULTS.header_timeout_s,
               max_connections: int = _DEFAULTS.max_connections, sock: socket.socket | None = None) -> None:
    """Serves until SIGINT/SIGTERM; then finishes the requests in flight and drains the scheduler.
    ``sock``: a socket bound to ``host:port`` already (``bind_socket``), else uvicorn binds one.

    Returns normally after a graceful shutdown (uvicorn re-raises the captured signal to the handler
    that was installed before it; ours only records it, so the process exits with status 0).
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and max_connections > soft - 64:
        log.warning("server.max_connections is %d, but this process may open only %d files (ulimit -n): raise the "
                    "limit or lower max_connections, or slow clients can exhaust them", max_connections, soft)
    server = _server(app, host=host, port=port, log_level=log_level,
                     timeout_graceful_shutdown=timeout_graceful_shutdown, header_timeout_s=header_timeout_s,
                     max_connections=max_connections)
    received: list[int] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda signum, frame: received.append(signum))
    try:
        server.run(sockets=None if sock is None else [sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        raise RuntimeError(f"the server did not start on {host}:{port} (see the log above)")


class ServerThread:
    """uvicorn on a background thread, bound to ``host`` and a free port (``port=0``); for tests.

    >>> with ServerThread(app) as srv:
    ...     httpx.get(srv.url + "/health")
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 timeout_graceful_shutdown: float | None = None, header_timeout_s: float = _DEFAULTS.header_timeout_s,
                 max_connections: int = _DEFAULTS.max_connections):
        self.app = app
        self.host = host
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port = self._sock.getsockname()[1]
        self.server = _server(app, host=host, port=self.port, log_level=log_level,
                              timeout_graceful_shutdown=timeout_graceful_shutdown, header_timeout_s=header_timeout_s,
                              max_connections=max_connections)
        self._thread = threading.Thread(target=self._run, name="uvicorn", daemon=True)
        self.error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self._sock])
        except BaseException as err:  # pragma: no cover - reported by start()
            self.error = err

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the server thread exited before starting: {self.error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not start within {timeout} s")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Graceful: stops accepting, finishes requests in flight, runs the lifespan shutdown (drain)."""
        self.server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the server did not stop within {timeout} s")

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
