"""Running the app under uvicorn: in the foreground (``serve.py``) or on a background thread (tests)."""

from __future__ import annotations

import signal
import socket
import threading
import time
from typing import Any

import uvicorn


def uvicorn_config(app: Any, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                   timeout_graceful_shutdown: float | None = None) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=timeout_graceful_shutdown,
        # SSE responses are streamed as they are produced; keep-alive connections close on shutdown.
        access_log=log_level == "debug",
    )


def run_server(app: Any, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
               timeout_graceful_shutdown: float | None = None) -> None:
    """Serves until SIGINT/SIGTERM; then finishes the requests in flight and drains the scheduler.

    Returns normally after a graceful shutdown (uvicorn re-raises the captured signal to the handler
    that was installed before it; ours only records it, so the process exits with status 0).
    """
    server = uvicorn.Server(uvicorn_config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=timeout_graceful_shutdown))
    received: list[int] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda signum, frame: received.append(signum))
    try:
        server.run()
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
                 timeout_graceful_shutdown: float | None = None):
        self.app = app
        self.host = host
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port = self._sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn_config(app, host=host, port=self.port, log_level=log_level,
                                                    timeout_graceful_shutdown=timeout_graceful_shutdown))
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
