"""The HTTP plumbing of the reward server (:mod:`rlpost_rewards.server`): its resource limits, and a
``ThreadingHTTPServer`` that bounds the open connections and closes each one with a lingering read.

What a request may hold is :mod:`rlpost_rewards._wire`'s; how a request is answered is the server's handler.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ._wire import WireLimits

__all__ = ["MAX_TIMEOUT_S", "RewardHTTPServer", "ServerLimits"]

MAX_TIMEOUT_S = 86400.0  # a day: sockets and semaphores refuse timeouts past ~292 years, and no request needs one


@dataclass(frozen=True)
class ServerLimits:
    """Resource limits of the reward server.

    Attributes:
        wire: Per-request size limits (body bytes, images, pixels).
        timeout_s: Socket inactivity timeout, and the deadline for receiving one request body.
        max_connections: Open connections served at once; more are answered 503 and closed.
        max_concurrent: Requests read, decoded and scored at once; others wait up to ``timeout_s``, then get 503.
        linger_s: After answering, how long the server keeps reading (and discarding) what the client still sends
            before closing, so the client reads the answer instead of a connection reset.
    """

    wire: WireLimits = field(default_factory=WireLimits)
    timeout_s: float = 60.0
    max_connections: int = 16
    max_concurrent: int = 2
    linger_s: float = 2.0

    def __post_init__(self) -> None:
        if not (
            0 < self.timeout_s <= MAX_TIMEOUT_S
            and 0 <= self.linger_s <= MAX_TIMEOUT_S
            and self.max_connections >= 1
            and self.max_concurrent >= 1
        ):
            raise ValueError(
                f"need 0 < timeout_s <= {MAX_TIMEOUT_S:g}, 0 <= linger_s <= {MAX_TIMEOUT_S:g} (seconds), "
                f"max_connections >= 1, max_concurrent >= 1: {self}"
            )


def _json_response(status: int, body: dict[str, Any], extra: str = "") -> bytes:
    data = json.dumps(body).encode("utf-8")
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n{extra}\r\n"
    )
    return head.encode("latin-1") + data


class RewardHTTPServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` with a bounded number of connections and a lingering close.

    Args:
        address: ``(host, port)`` to bind.
        handler: The request handler class.
        limits: Resource limits.
    """

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], limits: ServerLimits) -> None:
        self.limits = limits
        self._connections = threading.BoundedSemaphore(limits.max_connections)
        self.work_slots = threading.BoundedSemaphore(limits.max_concurrent)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        """Start a thread for the connection, or answer 503 at once when ``max_connections`` are open."""
        if not self._connections.acquire(blocking=False):
            busy = {"error": f"server busy: {self.limits.max_connections} connections open (--max-connections)"}
            try:
                request.settimeout(0.05)  # never block the accept loop: a short read of what already arrived
                request.recv(65536)
            except OSError:
                pass
            try:
                request.settimeout(1.0)
                request.sendall(_json_response(503, busy, "Retry-After: 1\r\n"))
                request.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            self.close_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._connections.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        """Serve one connection, then free its connection slot."""
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._connections.release()

    def shutdown_request(self, request: Any) -> None:
        """Close after a short lingering read: closing a socket with unread input sends a reset, which can destroy
        the answer (e.g. a 413 sent before the oversize body was read) before the client reads it."""
        try:
            request.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + self.limits.linger_s  # bounded by time only: reading costs no memory
            while (remaining := deadline - time.monotonic()) > 0:
                request.settimeout(remaining)
                if not request.recv(1 << 20):
                    break
        except OSError:
            pass
        self.close_request(request)
