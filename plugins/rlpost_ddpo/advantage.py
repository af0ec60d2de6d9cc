"""DDPO's per-prompt reward normalisation (``kvablack/ddpo-pytorch`` ``ddpo_pytorch/stat_tracking.py``@1958463),
restated.

For each prompt the tracker keeps a FIFO buffer of its last ``buffer_size`` rewards. At every step, for each
distinct prompt of the batch, the prompt's new rewards are appended to its buffer *first*; then::

    len(buffer) <  min_count:  A = (R - mean(R_batch)) / (std(R_batch) + 1e-6)      (global fallback)
    len(buffer) >= min_count:  A = (R - mean(buffer)) / (std(buffer) + 1e-6)

with population (ddof 0) standard deviations, as numpy's ``np.std``. ``R_batch`` are all rewards of the step.
The buffers persist across steps (``state_dict`` / ``load_state_dict`` for resume).
"""

from __future__ import annotations

from collections import deque
from typing import Annotated, Any, ClassVar

import torch
from torch import Tensor

from rlpost import AdvantageEstimator, Advantages, Range, RewardScores, Rollout, broadcast_to_edges

__all__ = ["PerPromptStatTracker"]

STD_EPS = 1e-6  # ddpo-pytorch adds 1e-6 to both the buffer and the batch std


class PerPromptStatTracker(AdvantageEstimator):
    """DDPO's per-prompt running normalisation of the (weighted) reward, broadcast to each chain's trainable edges.

    Args:
        buffer_size: Rewards kept per prompt (ddpo-pytorch ``per_prompt_stat_tracking.buffer_size``, 16 / 32).
        min_count: Below this many buffered rewards a prompt uses the batch mean/std (ddpo-pytorch 16).
    """

    name: ClassVar[str] = "per-prompt"
    requires: ClassVar[frozenset[str]] = frozenset({"chains"})

    def __init__(
        self, buffer_size: Annotated[int, Range(ge=1)] = 16, min_count: Annotated[int, Range(ge=1)] = 16
    ) -> None:
        self.buffer_size = int(buffer_size)
        self.min_count = int(min_count)
        self.buffers: dict[str, deque[float]] = {}

    def validate(self, recipe: Any) -> list[str]:
        """Check ``buffer_size >= 1`` and ``1 <= min_count <= buffer_size`` (else the buffer is never used)."""
        problems = []
        if self.min_count > self.buffer_size:
            problems.append(
                f"advantage.init_args.min_count: {self.min_count} exceeds buffer_size {self.buffer_size}, so the "
                "per-prompt statistics would never be used"
            )
        return problems

    def update(self, prompts: list[str], rewards: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``rewards`` to their prompts' buffers and normalise them.

        Args:
            prompts: ``S`` prompt strings.
            rewards: ``[S]`` rewards.

        Returns:
            ``([S] advantages, [S] bool: sample used the global fallback)``.
        """
        r = rewards.double().cpu()
        batch_mean, batch_std = r.mean(), r.std(unbiased=False) + STD_EPS
        adv = torch.zeros_like(r)
        fallback = torch.zeros(r.shape[0], dtype=torch.bool)
        for prompt in dict.fromkeys(prompts):
            rows = torch.tensor([i for i, p in enumerate(prompts) if p == prompt])
            buf = self.buffers.setdefault(prompt, deque(maxlen=self.buffer_size))
            buf.extend(r[rows].tolist())
            if len(buf) < self.min_count:
                mean, std = batch_mean, batch_std
                fallback[rows] = True
            else:
                values = torch.tensor(list(buf), dtype=torch.float64)
                mean, std = values.mean(), values.std(unbiased=False) + STD_EPS
            adv[rows] = (r[rows] - mean) / std
        return adv.float(), fallback

    def estimate(self, rollout: Rollout, scores: RewardScores) -> Advantages:
        """Normalise the weighted reward per prompt and give each trainable edge its sample's advantage."""
        adv, fallback = self.update(rollout.sample_prompts, scores.weighted_sum())
        edges = broadcast_to_edges(rollout, adv)
        metrics = {
            "adv/global_fallback_frac": float(fallback.float().mean()),
            "adv/tracked_prompts": float(len(self.buffers)),
            "adv/abs_mean": float(adv.abs().mean()),
            "adv/max": float(adv.max()),
            "adv/min": float(adv.min()),
        }
        return Advantages(edges=edges, samples=adv, metrics=metrics)

    def state_dict(self) -> dict[str, Any]:
        """The per-prompt buffers (JSON-serialisable) and the settings they were filled with."""
        return {
            "buffer_size": self.buffer_size,
            "min_count": self.min_count,
            "buffers": {p: list(b) for p, b in self.buffers.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the buffers (truncated to this tracker's ``buffer_size``, keeping the newest values)."""
        self.buffers = {p: deque(values, maxlen=self.buffer_size) for p, values in state.get("buffers", {}).items()}
