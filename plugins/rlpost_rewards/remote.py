"""A reward computed by another process or machine over HTTP (see :mod:`rlpost_rewards.server`).

Remote rewards isolate conflicting reward stacks (ImageReward's old pins, HPS's protobuf) from the trainer's
environment and let one GPU host score for several trainers (as the HTTP reward servers behind
``kvablack/ddpo-pytorch ddpo_pytorch/rewards.py@1958463`` do). The wire format is JSON + base64 PNG
(:mod:`rlpost_rewards._wire`).

The client trusts the server no more than the server trusts it: every HTTP request is bounded by a wall-clock
deadline (a watchdog closes the socket, so a server that trickles bytes cannot hold the trainer), the response size
is capped, its JSON is counted and depth-checked before it is parsed (:mod:`rlpost_rewards._jsonscan`), and the
answer must match a strict schema. Every failure (no connection, a timeout, an HTTP error, an answer that is not
JSON or not scores, numbers too large for a float) is a :class:`RemoteRewardError` that names the URL and carries
the server's own message when it sent one.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import socket
import threading
import time
import urllib.parse
from typing import Annotated, Any, ClassVar

import torch
from torch import Tensor

from rlpost import InvalidArguments, Range, RewardSource

from ._common import check_images, check_scores
from ._http import MAX_TIMEOUT_S
from ._jsonscan import JSONLimitError, count_values, loads_bounded
from ._options import token_problem
from ._wire import MAX_JSON_DEPTH, WireLimits, encode_images, jsonable_metadata

__all__ = ["MAX_RESPONSE_BYTES", "RemoteReward", "RemoteRewardError"]

MAX_RESPONSE_BYTES = 16 * 1024 * 1024  # scores of a few thousand images are a few kB
_ANSWER_VALUES = 1024  # JSON values an answer may hold beyond one per score (/health's limits, an error message)
_MAX_BACKOFF_S = 60.0  # the doubling back-off stops growing here


class RemoteRewardError(RuntimeError):
    """The reward server could not be reached, refused the request, or answered something that is not scores."""


class _DeadlineExceeded(Exception):
    pass


def _server_message(data: bytes) -> str:
    """The ``error`` of a JSON error body, else the start of the body as text."""
    text = data.decode("utf-8", "replace")
    try:
        body = loads_bounded(data, _ANSWER_VALUES, MAX_JSON_DEPTH, "answer")
    except ValueError:  # not UTF-8, not JSON, or over the limits: quote the text
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return str(body["error"])[:2000]
    return (text[:300] + ("..." if len(text) > 300 else "")) or "<empty body>"


class RemoteReward(RewardSource):
    """Scores images by POSTing them to a reward server.

    Args:
        url: Base URL of the server, e.g. ``http://10.0.0.5:8765`` (``/health`` and ``/score`` are appended).
        timeout_s: Wall-clock deadline of one HTTP request (connect, send, wait, receive), at most a day: the call
            is cut when it expires, however the server behaves. A ``score`` call takes at most about
            ``(retries + 1) x timeout_s`` plus the back-off delays (per request when a batch is split).
        retries: Extra attempts after a failed request (connection errors, timeouts, HTTP 5xx, 408, 429); other
            HTTP 4xx answers are not retried.
        backoff_s: First back-off delay; doubles after each failed attempt, up to 60 s (or ``backoff_s`` if larger).
        expect_reward: When set, ``setup`` checks the server serves this reward name.
        token_env: Name of the environment variable holding the server's bearer token (sent as
            ``Authorization: Bearer ...`` when the variable is set). The token itself never appears in a recipe or
            in the run directory.
    """

    name: ClassVar[str] = "remote"

    def __init__(
        self,
        url: str = "http://127.0.0.1:8765",
        timeout_s: Annotated[float, Range(gt=0, le=MAX_TIMEOUT_S)] = 120.0,
        retries: Annotated[int, Range(ge=0)] = 3,
        backoff_s: Annotated[float, Range(ge=0, le=MAX_TIMEOUT_S)] = 0.5,
        expect_reward: str | None = None,
        token_env: str | None = "RLPOST_REWARD_TOKEN",
    ) -> None:
        try:
            parts = urllib.parse.urlsplit(url)
        except ValueError as err:  # e.g. an unclosed IPv6 bracket
            raise InvalidArguments(
                type(self).__name__, {"url": f"must look like http://host:port, got {url!r} ({err})"}
            ) from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidArguments(
                type(self).__name__, {"url": f"must look like http://host:port or https://host, got {url!r}"}
            )
        if parts.query or parts.fragment or parts.username or parts.password:
            raise InvalidArguments(
                type(self).__name__, {"url": f"must not carry credentials, a query or a fragment, got {url!r}"}
            )
        try:
            parts.port  # noqa: B018 - raises on a bad port
        except ValueError as err:
            raise InvalidArguments(type(self).__name__, {"url": f"bad port in {url!r}: {err}"}) from None
        if not isinstance(retries, int) or isinstance(retries, bool):  # a range check takes 1.5; range() would not
            raise InvalidArguments(type(self).__name__, {"retries": f"must be an integer >= 0, got {retries!r}"})
        self.url = url.rstrip("/")
        self._parts = parts
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.expect_reward = expect_reward
        self.token_env = token_env
        self.server_reward: str | None = None
        self.server_limits: WireLimits | None = None

    # ------------------------------------------------------------------------------------------------ transport
    def _headers(self, has_body: bool) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if has_body:
            headers["Content-Type"] = "application/json"
        token = os.environ.get(self.token_env) if self.token_env else None
        if token:
            problem = token_problem(token)
            if problem is not None:  # it could not travel in a header (or match one)
                raise RemoteRewardError(
                    f"{self.name}: cannot send the bearer token in ${self.token_env} to {self.url}: it {problem}"
                )
            headers["Authorization"] = f"Bearer {token}"
        return headers

    def _once(self, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        """One HTTP exchange, cut after ``timeout_s`` of wall-clock time whatever the server does.

        Socket timeouts bound each read, not the exchange (a server sending one byte per second never trips them);
        a watchdog timer shuts the socket down at the deadline, which wakes any blocked call.
        """
        parts = self._parts
        conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = conn_cls(parts.hostname or "", parts.port, timeout=self.timeout_s)
        expired = threading.Event()

        def abort() -> None:
            expired.set()
            sock = conn.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        watchdog = threading.Timer(self.timeout_s, abort)
        watchdog.daemon = True
        watchdog.start()
        try:
            try:
                conn.request(method, parts.path.rstrip("/") + path, body=body, headers=self._headers(body is not None))
            except (BrokenPipeError, ConnectionResetError):
                # The server answered and closed before reading the whole body (e.g. 413): read that answer.
                if expired.is_set() or conn.sock is None:
                    raise
            response = conn.getresponse()
            data = response.read(MAX_RESPONSE_BYTES + 1)
            if len(data) > MAX_RESPONSE_BYTES:
                raise RemoteRewardError(
                    f"{self.name}: {self.url}{path} answered more than {MAX_RESPONSE_BYTES} bytes; not a reward server?"
                )
            return response.status, data
        except (OSError, http.client.HTTPException) as err:
            if expired.is_set():
                raise _DeadlineExceeded from err
            raise
        finally:
            watchdog.cancel()
            conn.close()

    def _request(self, path: str, payload: dict[str, Any] | None, max_values: int = _ANSWER_VALUES) -> dict[str, Any]:
        """GET (``payload is None``) or POST JSON to ``path`` with retries; return the JSON object answered, which
        may hold at most ``max_values`` JSON values.

        Raises:
            RemoteRewardError: On any failure, with the server's own message when it answered.
        """
        url = f"{self.url}{path}"
        body = None if payload is None else json.dumps(payload).encode("utf-8")
        method = "GET" if body is None else "POST"
        delay = self.backoff_s
        last = ""
        answered = False  # did the last attempt get an HTTP answer (vs. no connection / no answer in time)?
        for attempt in range(self.retries + 1):
            try:
                status, data = self._once(method, path, body)
            except _DeadlineExceeded:
                last, answered = f"no complete answer within timeout_s={self.timeout_s}s", False
            except (OSError, http.client.HTTPException, ValueError, OverflowError) as err:
                # OSError: refused, reset, unreachable, TLS; HTTPException: not HTTP; ValueError/OverflowError:
                # what http.client raises on headers or lengths it cannot use.
                last, answered = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}", False
            else:
                if status == 200:
                    return self._json_object(url, data, max_values)
                message = _server_message(data)
                if status == 401:
                    hint = (
                        f"the environment variable {self.token_env} is not set"
                        if not (self.token_env and os.environ.get(self.token_env))
                        else f"check the token in {self.token_env}"
                    )
                    raise RemoteRewardError(f"{self.name}: {url} refused the token (HTTP 401: {message}); {hint}")
                if 400 <= status < 500 and status not in (408, 429):
                    raise RemoteRewardError(f"{self.name}: {url} rejected the request (HTTP {status}: {message})")
                last, answered = f"HTTP {status}: {message}", True
            if attempt < self.retries:
                time.sleep(delay)
                delay = min(delay * 2, max(self.backoff_s, _MAX_BACKOFF_S))
        attempts = f"{self.retries + 1} attempt(s)"
        if answered:
            raise RemoteRewardError(f"{self.name}: reward server {url} failed after {attempts}: {last}")
        raise RemoteRewardError(
            f"{self.name}: no answer from reward server {url} after {attempts} "
            f"(timeout {self.timeout_s}s; last error: {last}). Is it running? Start one with "
            "`python -m rlpost_rewards.server --reward <name> --host <host> --port <port>`."
        )

    def _json_object(self, url: str, data: bytes, max_values: int) -> dict[str, Any]:
        try:
            body = loads_bounded(data, max_values, MAX_JSON_DEPTH, "answer")
        except JSONLimitError as err:
            raise RemoteRewardError(
                f"{self.name}: {url} answered HTTP 200, but the {err}; not a reward server?"
            ) from None
        except ValueError:  # not UTF-8 or not JSON
            raise RemoteRewardError(
                f"{self.name}: {url} answered HTTP 200 with a body that is not JSON: {_server_message(data)!r}"
            ) from None
        if not isinstance(body, dict):
            raise RemoteRewardError(f"{self.name}: {url} answered {type(body).__name__}, expected a JSON object")
        return body

    # ------------------------------------------------------------------------------------------------ reward API
    def setup(self, device: torch.device) -> None:
        """Check the server answers ``/health`` (and serves ``expect_reward`` when set); read its limits."""
        health = self._request("/health", None)
        reward = health.get("reward")
        if health.get("status") != "ok" or not isinstance(reward, str):
            raise RemoteRewardError(f"{self.name}: {self.url}/health answered {str(health)[:300]}")
        self.server_reward = reward
        if self.expect_reward is not None and self.server_reward != self.expect_reward:
            raise RemoteRewardError(
                f"{self.name}: {self.url} serves {self.server_reward!r}, expected {self.expect_reward!r}"
            )
        limits = health.get("limits")
        try:
            self.server_limits = WireLimits(**limits) if isinstance(limits, dict) else None
        except (TypeError, ValueError):
            self.server_limits = None  # an older or foreign server: send whole batches

    def _batches(self, encoded: list[str], pixels: int, prompts: list[str], metadata: list[Any]) -> list[slice]:
        """Split one score call into requests that fit the server's limits (one request when they are unknown)."""
        limits = self.server_limits
        if limits is None:
            return [slice(0, len(encoded))]
        if pixels > limits.max_pixels:
            raise RemoteRewardError(
                f"{self.name}: images of {pixels} pixels exceed {self.url}'s limit of {limits.max_pixels} per image"
            )
        budget = limits.max_body_bytes * 9 // 10 - 1024  # JSON punctuation and headroom (integers: no overflow)
        value_budget = limits.max_json_values - 16  # the request object, its three lists and their keys
        out: list[slice] = []
        start = size = values = 0
        for i, item in enumerate(encoded):
            meta = json.dumps(metadata[i]).encode("utf-8")
            cost = len(item) + len(json.dumps(prompts[i])) + len(meta) + 8
            try:  # image, prompt, metadata and their commas, plus what the metadata holds
                item_values = 4 + count_values(meta, value_budget, MAX_JSON_DEPTH - 3, f"metadata[{i}]")
            except JSONLimitError as err:
                raise RemoteRewardError(f"{self.name}: {err}, over {self.url}'s limits for one request") from None
            if cost > budget:
                raise RemoteRewardError(
                    f"{self.name}: one image is {cost} bytes encoded, over {self.url}'s body limit of "
                    f"{limits.max_body_bytes} bytes"
                )
            count = i - start
            if i > start and (
                size + cost > budget
                or values + item_values > value_budget
                or count + 1 > limits.max_images
                or (count + 1) * pixels > limits.max_total_pixels
            ):
                out.append(slice(start, i))
                start, size, values = i, 0, 0
            size += cost
            values += item_values
        out.append(slice(start, len(encoded)))
        return out

    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor:
        """POST the images (PNG) with prompts and metadata; return the server's scores, fp32 on CPU.

        Raises:
            RemoteRewardError: On any transport failure, server error, or answer that is not one finite number
                per image.
        """
        check_images(self.name, images, prompts)
        encoded = encode_images(images)
        meta = jsonable_metadata(list(metadata) if metadata else [{} for _ in prompts])
        pixels = int(images.shape[1] * images.shape[2])
        scores: list[float] = []
        for part in self._batches(encoded, pixels, list(prompts), meta):
            payload = {"images": encoded[part], "prompts": list(prompts[part]), "metadata": meta[part]}
            count = len(encoded[part])
            scores.extend(self._scores(self._request("/score", payload, count + _ANSWER_VALUES), count))
        return check_scores(self.name, torch.tensor(scores, dtype=torch.float32))

    def _scores(self, body: dict[str, Any], count: int) -> list[float]:
        """The ``scores`` of a ``/score`` answer, checked: a list of ``count`` finite numbers (not booleans)."""
        scores = body.get("scores")
        where = f"{self.name}: {self.url}/score"
        if not isinstance(scores, list):
            raise RemoteRewardError(f"{where} answered no 'scores' list: {str(body)[:300]}")
        if len(scores) != count:
            raise RemoteRewardError(f"{where} answered {len(scores)} scores for {count} images")
        bad = [s for s in scores if isinstance(s, bool) or not isinstance(s, (int, float)) or not _finite_float(s)]
        if bad:
            raise RemoteRewardError(f"{where} answered scores that are not finite numbers: {str(bad[:5])[:300]}")
        reward = body.get("reward")
        if self.server_reward is not None and reward is not None and reward != self.server_reward:
            raise RemoteRewardError(
                f"{where} scored with {str(reward)[:100]!r}, but /health said {self.server_reward!r}"
            )
        return [float(s) for s in scores]


def _finite_float(value: float) -> bool:
    """Whether ``value`` is a finite float once converted (a JSON integer of 400 digits is not: it overflows)."""
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False
