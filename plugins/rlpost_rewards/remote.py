"""A reward computed by another process or machine over HTTP (see :mod:`rlpost_rewards.server`).

Remote rewards isolate conflicting reward stacks (ImageReward's old pins, HPS's protobuf) from the trainer's
environment and let one GPU host score for several trainers (as the HTTP reward servers behind
``kvablack/ddpo-pytorch ddpo_pytorch/rewards.py@1958463`` do). The wire format is JSON + base64 PNG
(:mod:`rlpost_rewards._wire`).
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from typing import Any, ClassVar

import torch
from torch import Tensor

from rlpost.api import RewardSource

from ._common import check_images, check_scores
from ._wire import encode_images, jsonable_metadata

__all__ = ["RemoteReward", "RemoteRewardError"]


class RemoteRewardError(RuntimeError):
    """The reward server could not be reached or answered with an error."""


class RemoteReward(RewardSource):
    """Scores images by POSTing them to a reward server.

    Args:
        url: Base URL of the server, e.g. ``http://10.0.0.5:8765`` (``/health`` and ``/score`` are appended).
        timeout_s: Per-request timeout in seconds.
        retries: Extra attempts after a failed request (connection errors, timeouts, HTTP 5xx); HTTP 4xx is not
            retried.
        backoff_s: First back-off delay; doubles after each failed attempt.
        expect_reward: When set, ``setup`` checks the server serves this reward name.
    """

    name: ClassVar[str] = "remote"

    def __init__(
        self,
        url: str = "http://127.0.0.1:8765",
        timeout_s: float = 120.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        expect_reward: str | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{self.name}: url must start with http:// or https://, got {url!r}")
        if retries < 0 or timeout_s <= 0 or backoff_s < 0:
            raise ValueError(f"{self.name}: need retries >= 0, timeout_s > 0, backoff_s >= 0")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.expect_reward = expect_reward
        self.server_reward: str | None = None

    def _request(self, path: str, payload: dict[str, Any] | None) -> dict[str, Any]:
        """GET (``payload is None``) or POST JSON to ``path`` with retries and exponential back-off."""
        url = f"{self.url}{path}"
        data = None if payload is None else json.dumps(payload).encode("utf-8")
        headers = {"Content-Type": "application/json"} if data is not None else {}
        delay = self.backoff_s
        last = ""
        for attempt in range(self.retries + 1):
            request = urllib.request.Request(url, data=data, headers=headers, method="GET" if data is None else "POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:  # noqa: S310 - http(s) only
                    body: dict[str, Any] = json.loads(response.read().decode("utf-8"))
                    return body
            except urllib.error.HTTPError as err:
                message = err.read().decode("utf-8", "replace")
                try:
                    message = json.loads(message).get("error", message)
                except (ValueError, AttributeError):
                    pass
                last = f"HTTP {err.code}: {message}"
                if err.code < 500:
                    raise RemoteRewardError(f"{self.name}: {url} rejected the request ({last})") from err
            except (urllib.error.URLError, OSError, TimeoutError, ValueError) as err:
                last = f"{type(err).__name__}: {getattr(err, 'reason', err)}"
            if attempt < self.retries:
                time.sleep(delay)
                delay *= 2
        raise RemoteRewardError(
            f"{self.name}: no answer from reward server {url} after {self.retries + 1} attempt(s) "
            f"(timeout {self.timeout_s}s; last error: {last}). Is it running? Start one with "
            "`python -m rlpost_rewards.server --reward <name> --host <host> --port <port>`."
        )

    def setup(self, device: torch.device) -> None:
        """Check the server answers ``/health`` (and serves ``expect_reward`` when set)."""
        health = self._request("/health", None)
        if health.get("status") != "ok":
            raise RemoteRewardError(f"{self.name}: {self.url}/health answered {health}")
        self.server_reward = str(health.get("reward"))
        if self.expect_reward is not None and self.server_reward != self.expect_reward:
            raise RemoteRewardError(
                f"{self.name}: {self.url} serves {self.server_reward!r}, expected {self.expect_reward!r}"
            )

    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor:
        """POST the images (PNG) with prompts and metadata; return the server's scores, fp32 on CPU."""
        check_images(self.name, images, prompts)
        payload = {
            "images": encode_images(images),
            "prompts": list(prompts),
            "metadata": jsonable_metadata(list(metadata) if metadata else [{} for _ in prompts]),
        }
        body = self._request("/score", payload)
        scores = body.get("scores")
        if not isinstance(scores, list) or len(scores) != images.shape[0]:
            raise RemoteRewardError(f"{self.name}: expected {images.shape[0]} scores from {self.url}, got {scores!r}")
        if not all(isinstance(s, (int, float)) and math.isfinite(s) for s in scores):
            raise RemoteRewardError(f"{self.name}: non-finite or non-numeric scores from {self.url}: {scores}")
        return check_scores(self.name, torch.tensor(scores, dtype=torch.float32))
