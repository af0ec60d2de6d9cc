"""Overlap reward scoring with other work: score in a worker thread and get a future back.

Flow-GRPO computes rewards in a thread pool while it samples the next batch of the same epoch
(``yifan123/flow_grpo scripts/train_sd3.py@ac4c86e``: ``executor.submit(reward_fn, ...)``). Torch releases the GIL
inside kernels, so a CPU reward (JPEG, a remote call) or a reward on another GPU stream overlaps with that work::

    scorer = ThreadedScorer(reward)
    future = scorer.submit(images, prompts, metadata)   # returns at once
    ...                                                 # sample the next batch
    scores = future.result()                            # [S] tensor (re-raises the reward's exception)
    scorer.close()

The images must not be modified until the future completes (they are not copied). One worker per scorer, so
calls to one reward run in submission order and never concurrently.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any

from torch import Tensor

from rlpost import RewardSource

__all__ = ["ThreadedScorer"]


class ThreadedScorer:
    """Wraps a set-up :class:`~rlpost.core.api.RewardSource` so that ``submit`` scores in a background thread.

    Args:
        reward: The reward source (``setup`` already called).
    """

    def __init__(self, reward: RewardSource) -> None:
        self.reward = reward
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"reward-{reward.name}")

    def submit(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Future[Tensor]:
        """Start scoring and return a future of the ``[S]`` scores."""
        return self._pool.submit(self.reward.score, images, list(prompts), list(metadata))

    def close(self, wait: bool = True) -> None:
        """Stop the worker (after pending calls finish when ``wait``)."""
        self._pool.shutdown(wait=wait)

    def __enter__(self) -> ThreadedScorer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
