"""Spread-guided prompt selection: skip prompts whose last group's rewards all agreed (``run.min_group_spread``).

A GRPO or TreeGRPO group whose rewards (nearly) agree carries (almost) no signal, yet per-group z-scoring scales its
tiny differences up to unit advantages: the update then follows reward noise. DAPO's dynamic sampling (Yu et al.,
arXiv 2503.14476, Sec. 3.2) filters such groups *after* sampling them and samples more, which costs extra rollouts.
Here the decision is made *before* the rollout, from the spread the prompt's previous group showed, so the step's
budget (groups, hence transformer rows) is exactly the unfiltered run's: a skipped prompt's tree or chain is spent on
the next prompt of the stream instead.

Rule, per prompt text ``p`` (identical prompts share their record):

* after every step, ``spread[p]`` = the standard deviation (ddof 0) of the weighted reward sum
  (:meth:`~rlpost.core.contract.RewardScores.weighted_sum`) over the samples (leaves) of ``p``'s group, from the view
  gathered over all ranks, so every rank keeps identical records;
* when the stream offers ``p``: a prompt never seen, or with ``spread[p] >= min_spread``, is taken; otherwise it is
  skipped for this epoch, unless it was already skipped ``max_skips`` times in a row, then it is taken (its record
  is refreshed by that group, so a prompt that became informative again comes back).

**What it changes.** The rollout of a chosen prompt is untouched: its samples are draws from the current policy, and
its advantages are what they would be. The prompt mix changes: a prompt below the threshold is trained at most once
every ``max_skips + 1`` epochs instead of every epoch, so the update estimates a spread-weighted mixture over prompts
rather than the uniform one; it is not an unbiased estimate of the uniform-prompt gradient (nor is DAPO's filter).
Epochs pass faster in steps (each step consumes the skipped prompts too).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from rlpost.core.contract import RewardScores, Rollout
from rlpost.ops.reward_mixing import group_std

__all__ = ["SpreadFilter", "group_spreads"]


def group_spreads(rollout: Rollout, scores: RewardScores) -> dict[str, float]:
    """Standard deviation (ddof 0) of the weighted reward sum over each group's samples, keyed by the group's prompt.

    A prompt appearing in several groups of the step keeps its last group's value. A group with a non-finite reward
    (the runner's guard then skips the update) or no sample gives no value.
    """
    values = scores.weighted_sum().detach().double().cpu()
    groups = rollout.sample_group.long().cpu()
    keep = ~torch.isin(groups, groups[~torch.isfinite(values)])
    if not bool(keep.any()):
        return {}
    ids, std = group_std(values[keep], groups[keep])
    return {rollout.prompts[int(g)]: float(s) for g, s in zip(ids.tolist(), std.tolist(), strict=True)}


class SpreadFilter:
    """Skips prompts whose last observed group reward spread was below ``min_spread`` (see the module docstring).

    Args:
        min_spread: Threshold on the group reward standard deviation, in the units of the weighted reward sum.
        max_skips: Consecutive skips after which a low-spread prompt is taken anyway (``>= 1``).
    """

    def __init__(self, min_spread: float, max_skips: int = 2) -> None:
        if not (math.isfinite(min_spread) and min_spread > 0):
            raise ValueError(f"min_spread must be a positive finite number, got {min_spread}")
        if max_skips < 1:
            raise ValueError(f"max_skips must be >= 1, got {max_skips}")
        self.min_spread = float(min_spread)
        self.max_skips = int(max_skips)
        self.spread: dict[str, float] = {}
        self.skips: dict[str, int] = {}
        self.skipped_last_batch = 0

    def begin_batch(self) -> None:
        """Start counting the prompts passed over while the stream draws one batch."""
        self.skipped_last_batch = 0

    def admit(self, prompt: str) -> bool:
        """Whether the stream should use ``prompt`` now (``False``: skip it for this epoch); updates the skip count."""
        spread = self.spread.get(prompt)
        if spread is None or spread >= self.min_spread or self.skips.get(prompt, 0) >= self.max_skips:
            self.skips[prompt] = 0
            return True
        self.skips[prompt] = self.skips.get(prompt, 0) + 1
        self.skipped_last_batch += 1
        return False

    def observe(self, rollout: Rollout, scores: RewardScores) -> None:
        """Record the spreads of a step's groups (pass the view gathered over all ranks)."""
        self.spread.update(group_spreads(rollout, scores))

    def metrics(self) -> dict[str, float]:
        """``prompts/skipped`` (prompts passed over while drawing the last batch) and ``prompts/low_spread_frac``
        (the fraction of prompts seen so far whose last spread is below the threshold)."""
        low = sum(1 for s in self.spread.values() if s < self.min_spread)
        return {
            "prompts/skipped": float(self.skipped_last_batch),
            "prompts/low_spread_frac": low / len(self.spread) if self.spread else 0.0,
        }

    def state_dict(self) -> dict[str, Any]:
        """Per-prompt spreads and skip counts (a resumed run skips exactly what the uninterrupted one would)."""
        return {"spread": dict(self.spread), "skips": dict(self.skips)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.spread = {str(k): float(v) for k, v in state["spread"].items()}
        self.skips = {str(k): int(v) for k, v in state["skips"].items()}
