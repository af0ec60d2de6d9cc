"""Serve any local :class:`~rlpost.core.api.RewardSource` over HTTP for :class:`~rlpost_rewards.remote.RemoteReward`.

Example::

    python -m rlpost_rewards.server --reward jpeg-compressibility --host 127.0.0.1 --port 8765
    RLPOST_REWARD_TOKEN=$(openssl rand -hex 32) python -m rlpost_rewards.server --reward hps-v2.1 \\
        --init '{"checkpoint": "/models/HPS_v2.1_compressed.pt"}' --device cuda --host 0.0.0.0 --port 8765
    python -m rlpost_rewards.server --reward-class my_pkg.rewards:MyReward --port 8765

Endpoints: ``GET /health`` and ``POST /score`` (JSON + base64 PNG, :mod:`rlpost_rewards._wire`; never pickle).

Limits (every one answers with an HTTP status and a JSON ``{"error": ...}`` naming the limit; none closes the
connection without an answer):

* body size, image count, pixels per image and per request (:class:`~rlpost_rewards._wire.WireLimits`), checked
  from the headers before any image is decompressed (413);
* JSON values per body (``--max-json-values``, 413) and nesting depth (32 levels, 400), counted before the body is
  parsed (:mod:`rlpost_rewards._jsonscan`): 4 MB of ``[{},{},...]`` would otherwise be 1.3 million dicts;
* ``--timeout``: per-socket inactivity timeout *and* a deadline for receiving a whole body, so a stalled client
  cannot hold a thread (408);
* ``--max-connections`` open connections (503 beyond) and ``--max-concurrent`` requests decoded/scored at once,
  which bounds memory to about ``max_concurrent x (3 x max_body_bytes + 100 x max_json_values + 6 x
  max_total_pixels)`` bytes (up to 9 x the body instead of 3 x when a long string holds a character beyond U+FFFF:
  Python then stores 4 bytes per character; measured figures in ``docs/rewards.md``); scoring itself is serialised
  by a lock because reward models are not assumed thread safe;
* optional bearer-token auth: when the environment variable named by ``--token-env`` (default
  ``RLPOST_REWARD_TOKEN``) is set, every request needs ``Authorization: Bearer <token>`` (401 otherwise; compared
  in constant time). The token is read from the environment, never from the command line, where other users of
  the machine could read it. A variable that is set but empty (or holds spaces or non-ASCII) refuses to start:
  serving without authentication then would fail open. Without a token the server warns when it binds a
  non-loopback address.

Every bad start option is a one-line usage error with exit status 2 (:mod:`rlpost_rewards._options`).
"""

from __future__ import annotations

import argparse
import errno
import hmac
import json
import math
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any

import torch

from rlpost import Registry, RewardSource

from ._http import RewardHTTPServer, ServerLimits
from ._jsonscan import JSONLimitError, loads_bounded
from ._options import (
    build_reward,
    is_loopback,
    load_reward_class,
    parse_device,
    server_parser,
    token_from_env,
    token_problem,
)
from ._wire import MAX_JSON_DEPTH, ImageLimitError, WireLimits, decode_images

__all__ = ["TOKEN_ENV", "RewardHTTPServer", "ServerLimits", "builtin_rewards", "make_server", "main"]

TOKEN_ENV = "RLPOST_REWARD_TOKEN"


def builtin_rewards() -> dict[str, type[RewardSource]]:
    """Name -> class of the rewards this plugin registers (collected through its own hook implementation)."""
    from . import rlpost_register_reward_sources

    # The real registry (not a list's append): the hook is typed Registry[RewardSource] and its checks apply.
    registry = Registry("reward", RewardSource)  # type: ignore[type-abstract]  # the base is an ABC by design
    rlpost_register_reward_sources(registry)
    return {name: registry.get(name).cls for name in registry.names()}


class _Refused(Exception):
    """Answer the current request with ``status`` and ``message`` (and close if the body was not read)."""

    def __init__(
        self, status: int, message: str, close: bool = False, headers: tuple[tuple[str, str], ...] = ()
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.close, self.headers = status, message, close, headers


def make_server(
    reward: RewardSource,
    host: str = "127.0.0.1",
    port: int = 8765,
    token: str | None = None,
    limits: ServerLimits | None = None,
) -> RewardHTTPServer:
    """Build (but do not start) an HTTP server scoring with ``reward``, which must already be set up.

    Args:
        reward: A set-up reward source.
        host: Interface to bind (``127.0.0.1`` by default).
        port: TCP port (0 picks a free one; read it back from ``server.server_address``).
        token: When set, every request must carry ``Authorization: Bearer <token>``.
        limits: Resource limits (defaults: :class:`ServerLimits`).

    Returns:
        The server; call ``serve_forever()`` (e.g. in a thread) and ``shutdown()``/``server_close()`` to stop.
    """
    lim = limits or ServerLimits()
    if token is not None and (problem := token_problem(token)) is not None:
        raise ValueError(f"the bearer token {problem}: give a secret of printable ASCII, or None for no authentication")
    expected = token.encode("ascii") if token is not None else None
    score_lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        default_request_version = "HTTP/1.1"  # answer even a garbled request line with headers and JSON
        server_version = "rlpost-reward-server"
        timeout = lim.timeout_s  # StreamRequestHandler applies it to the socket: idle or stalled clients drop
        server: RewardHTTPServer

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
            """Silence per-request logging."""

        def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
            """The stdlib's own errors (malformed request line, header too long, unsupported method) as JSON."""
            self.close_connection = True
            self._send(code, {"error": message or HTTPStatus(code).phrase})

        def _send(self, status: int, body: dict[str, Any], headers: tuple[tuple[str, str], ...] = ()) -> None:
            data = json.dumps(body).encode("utf-8")
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for key, value in headers:
                    self.send_header(key, value)
                if self.close_connection:
                    self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(data)
                self.wfile.flush()
            except OSError:  # the client is gone; nobody to answer
                self.close_connection = True

        def _check_token(self) -> None:
            if expected is None:
                return
            scheme, _, value = self.headers.get("Authorization", "").partition(" ")
            if not (scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode("utf-8"), expected)):
                raise _Refused(
                    401,
                    "missing or wrong bearer token: this server requires 'Authorization: Bearer <token>' "
                    f"(the client reads it from the environment variable named by token_env, default {TOKEN_ENV})",
                    close=True,
                    headers=(("WWW-Authenticate", 'Bearer realm="rlpost-reward-server"'),),
                )

        def _handle(self, action: Any) -> None:
            try:
                action()
            except _Refused as refusal:
                if refusal.close:
                    self.close_connection = True
                self._send(refusal.status, {"error": refusal.message}, refusal.headers)
            except Exception as err:  # noqa: BLE001 - every failure gets an answer
                self.close_connection = True
                self._send(500, {"error": f"internal error: {type(err).__name__}: {err}"})

        def do_GET(self) -> None:  # noqa: N802 - stdlib naming
            self._handle(self._get)

        def do_POST(self) -> None:  # noqa: N802 - stdlib naming
            self._handle(self._post)

        def _get(self) -> None:
            self._check_token()
            if self.path != "/health":
                raise _Refused(404, f"unknown path {self.path[:200]!r}; endpoints: GET /health, POST /score")
            self._send(200, {"status": "ok", "reward": reward.name, "limits": lim.wire.to_json()})

        def _post(self) -> None:
            self._check_token()
            if self.path != "/score":
                raise _Refused(404, f"unknown path {self.path[:200]!r}; endpoints: GET /health, POST /score", True)
            length = self._content_length()
            if not self.server.work_slots.acquire(timeout=lim.timeout_s):
                raise _Refused(
                    503,
                    f"server busy: {lim.max_concurrent} requests in progress for {lim.timeout_s}s (--max-concurrent)",
                    close=True,
                    headers=(("Retry-After", "1"),),
                )
            try:
                images, prompts, metadata = self._parse(self._read_body(length))
                try:
                    with score_lock:
                        scores = _checked_scores(reward.score(images, prompts, metadata), len(prompts))
                except Exception as err:  # noqa: BLE001 - a scoring failure is the server's 500, with its message
                    raise _Refused(500, f"scoring failed: {type(err).__name__}: {err}") from None
            finally:
                self.server.work_slots.release()
            self._send(200, {"scores": scores, "reward": reward.name})

        def _content_length(self) -> int:
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                raise _Refused(411, "chunked request bodies are not supported: send a Content-Length", True)
            raw = self.headers.get("Content-Length")
            if raw is None:
                raise _Refused(411, "a Content-Length header is required", True)
            try:
                length = int(raw.strip())
            except ValueError:
                raise _Refused(400, f"bad Content-Length {raw[:40]!r}: expected a number of bytes", True) from None
            if length <= 0:
                raise _Refused(400, f"bad Content-Length {length}: the body must hold a JSON object", True)
            if length > lim.wire.max_body_bytes:
                raise _Refused(
                    413,
                    f"body of {length} bytes is over the server's limit of {lim.wire.max_body_bytes} bytes "
                    "(send fewer or smaller images per request)",
                    True,
                )
            return length

        def _read_body(self, length: int) -> bytearray:
            """Read exactly ``length`` bytes within ``timeout_s`` in total (not per packet: a client trickling one
            byte at a time must not hold the connection), into one buffer (no second copy from joining chunks)."""
            deadline = time.monotonic() + lim.timeout_s
            body = bytearray(length)  # zero pages are not resident until written: memory follows what arrived
            got = 0
            try:
                with memoryview(body) as view:
                    while got < length:
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            raise TimeoutError
                        self.connection.settimeout(remaining)
                        count = self.rfile.readinto1(view[got:])
                        if not count:
                            self.close_connection = True
                            raise _Refused(400, f"body ended after {got} of {length} bytes", True)
                        got += count
            except TimeoutError:
                raise _Refused(
                    408, f"request body not received within {lim.timeout_s}s ({got} of {length} bytes)", True
                ) from None
            finally:
                self.connection.settimeout(lim.timeout_s)
            return body

        def _parse(self, body: bytearray) -> tuple[torch.Tensor, list[str], list[dict[str, Any]]]:
            try:
                request = loads_bounded(body, lim.wire.max_json_values, MAX_JSON_DEPTH)
            except JSONLimitError as err:
                if err.limit == "depth":
                    raise _Refused(400, f"{err}; the server's limit is {MAX_JSON_DEPTH}") from None
                raise _Refused(
                    413, f"{err}; the server's limit is {lim.wire.max_json_values} (--max-json-values)"
                ) from None
            except ValueError as err:  # not UTF-8, not JSON
                raise _Refused(400, f"body is not JSON: {err}") from None
            if not isinstance(request, dict):
                raise _Refused(400, f"body must be a JSON object with images and prompts, got {type(request).__name__}")
            for key in ("images", "prompts"):
                if not isinstance(request.get(key), list):
                    raise _Refused(400, f"{key}: expected a list, got {type(request.get(key)).__name__}")
            prompts = request["prompts"]
            if not all(isinstance(p, str) for p in prompts):
                raise _Refused(400, "prompts: expected a list of strings")
            metadata = request.get("metadata")
            if metadata is None:
                metadata = [{} for _ in prompts]
            if not isinstance(metadata, list) or not all(isinstance(m, dict) for m in metadata):
                raise _Refused(400, "metadata: expected a list of JSON objects (one per image)")
            if not (len(request["images"]) == len(prompts) == len(metadata)):
                raise _Refused(
                    400, f"{len(request['images'])} images, {len(prompts)} prompts, {len(metadata)} metadata entries"
                )
            try:
                images = decode_images(request["images"], lim.wire)
            except ImageLimitError as err:
                raise _Refused(413, str(err)) from None
            except ValueError as err:
                raise _Refused(400, str(err)) from None
            return images, prompts, metadata

    return RewardHTTPServer((host, port), Handler, lim)


def _checked_scores(scores: Any, count: int) -> list[float]:
    """The reward's output as a list of ``count`` finite floats (a broken reward is the server's 500, not NaN JSON)."""
    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"reward returned {type(scores).__name__}, expected a tensor")
    values = [float(s) for s in scores.detach().float().reshape(-1).cpu().tolist()]
    if len(values) != count:
        raise ValueError(f"reward returned {len(values)} scores for {count} images")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"reward returned non-finite scores {values[:8]}")
    return values


def _listen(
    reward: RewardSource, args: argparse.Namespace, token: str | None, limits: ServerLimits
) -> RewardHTTPServer:
    """Bind the server, or say in one line why the host and port cannot be used."""
    try:
        return make_server(reward, args.host, args.port, token=token, limits=limits)
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            problem = "is already in use (another server? pick another --port, or 0 for a free one)"
        else:
            problem = f"cannot be listened on: {err.strerror or err}"
        raise ValueError(f"--host {args.host} --port {args.port}: {args.host}:{args.port} {problem}") from None


def main(argv: list[str] | None = None) -> None:
    """Command-line entry: check the options, build the reward, bind, call ``setup`` once, serve until interrupted.

    Every bad option (and a reward that cannot be set up from them) is a one-line error with exit status 2.
    """
    parser = server_parser(__doc__ or "", sorted(builtin_rewards()), ServerLimits(), TOKEN_ENV)
    args = parser.parse_args(argv)
    try:
        limits = ServerLimits(
            wire=WireLimits(
                max_body_bytes=int(args.max_body_mb * 2**20),
                max_images=args.max_images,
                max_pixels=args.max_pixels,
                max_total_pixels=args.max_total_pixels,
                max_json_values=args.max_json_values,
            ),
            timeout_s=args.timeout,
            max_connections=args.max_connections,
            max_concurrent=args.max_concurrent,
        )
        token = token_from_env(args.token_env)
        if args.reward:
            table = builtin_rewards()
            if args.reward not in table:
                raise ValueError(f"--reward: unknown reward {args.reward!r}; built-ins: {', '.join(sorted(table))}")
            cls = table[args.reward]
        else:
            cls = load_reward_class(args.reward_class)
        device = parse_device(args.device)
        reward = build_reward(cls, args.init)
        server = _listen(reward, args, token, limits)
    except ValueError as err:
        parser.error(str(err))
    try:
        reward.setup(device)
    except (OSError, ValueError) as err:  # a checkpoint the options point at is missing or unusable
        server.server_close()
        parser.error(f"setting up reward {reward.name!r} failed: {type(err).__name__}: {err}")
    if token is None and not is_loopback(args.host):
        print(
            f"warning: serving on {args.host} without authentication: anyone who can reach it can use it. Set "
            f"{args.token_env} (here and in the trainer's environment) to require a bearer token.",
            file=sys.stderr,
        )
    host, bound_port = server.server_address[:2]
    host = host.decode() if isinstance(host, bytes) else host
    auth = "bearer token required" if token else "no authentication"
    print(
        f"serving reward {reward.name!r} on http://{host}:{bound_port} (GET /health, POST /score; {auth})",
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
