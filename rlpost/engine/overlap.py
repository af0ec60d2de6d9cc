"""Overlapped rollouts (``run.speedups.overlap_groups``): a step is sampled in parts of a few prompt groups, and
each finished part is scored (every reward source, on its decoded samples) in a worker thread while the next part's
transformer work runs.

On a GPU the transformer, the VAE and the reward models queue kernels on the same device, so the reward models' work
fills the gaps between rollout kernels instead of waiting for the whole step's rollout; on a CPU the two share the
cores. What is computed is unchanged: parts use per-group noise streams (:func:`rlpost.engine.sharding.
group_rollouts`), rewards are batch independent (the conformance kit checks it), and the merged rollout and scores
are those of one rollout of every group, up to floating-point batch effects (tests/unit/test_overlap.py). Rows
counted by ``Policy.forward_count`` are the same; only the number of transformer calls grows.

The worker scores with half of the process's intra-op CPU threads (at least one; ``torch.set_num_threads`` in a
worker thread sets that thread's OpenMP team only): with a full team of its own, each concurrent CPU op of the worker
oversubscribed the cores the sampler's ops were using, and on a 2-core machine a step with overlap took 2.2x as long
as without it; with one worker thread the split alone is left (docs/speed.md).

Hooks see the same order as without overlap (``rlpost_after_rollout`` before ``rlpost_after_rewards``), but both
run after the whole step was sampled and scored, so an ``after_rollout`` hook can no longer change what is scored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from rlpost.core.contract import RewardScores, Rollout
from rlpost.core.merge import merge_rollouts

__all__ = ["merge_scores", "sample_and_score"]


def sample_and_score(
    parts: Iterable[Rollout], score: Callable[[Rollout], RewardScores]
) -> tuple[Rollout, RewardScores]:
    """Draw ``parts`` (an iterator that samples each part when asked) and score each in a worker thread while the next
    one samples; returns the merged rollout and scores.

    Raises:
        Whatever sampling or ``score`` raised (a part's exception surfaces when its result is collected).
    """
    pending: list[tuple[Rollout, Future[RewardScores]]] = []
    threads = max(1, torch.get_num_threads() // 2)
    with ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="rlpost-overlap", initializer=torch.set_num_threads, initargs=(threads,)
    ) as pool:
        for part in parts:  # sampling part i + 1 (this thread) overlaps scoring part i (the worker)
            pending.append((part, pool.submit(score, part)))
        scores = [future.result() for _, future in pending]
    return merge_rollouts([part for part, _ in pending]), merge_scores(scores)


def merge_scores(parts: list[RewardScores]) -> RewardScores:
    """Per-source scores of consecutive parts, concatenated in part order (the order :func:`merge_rollouts` keeps
    their samples in)."""
    names = list(parts[0].scores)
    return RewardScores(
        scores={name: torch.cat([p.scores[name] for p in parts]) for name in names}, weights=dict(parts[0].weights)
    )
