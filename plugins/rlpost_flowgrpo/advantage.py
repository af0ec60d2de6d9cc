"""Flow-GRPO's per-prompt advantages (``yifan123/flow_grpo`` ``flow_grpo/stat_tracking.py``@9745241 L11-32,
``scripts/train_sd3.py``@9745241 L743-787).

Upstream groups the rewards of one step by prompt *text* (``PerPromptStatTracker.update``, cleared every epoch) and
computes, with numpy's population std (``ddof = 0``) and ``+1e-4``::

    A_j = (R_j - mean_p(R)) / (std_all(R) + 1e-4)       global_std: true (every Flow-GRPO SD3.5 preset)
    A_j = (R_j - mean_p(R)) / (std_p(R) + 1e-4)         global_std: false (GRPO-Guard's presets)

where ``p`` is the sample's prompt and ``std_all`` the std of every reward gathered from all ranks. Several reward
sources are summed with their weights first (upstream's ``avg`` reward), i.e. ``mix: reward``. The built-in
``group-zscore`` matches the ``global_std: true`` case per prompt *group* but takes the Bessel-corrected (``n - 1``)
group std when ``global_std`` is off, so GRPO-Guard's presets need this estimator; ``group_by: prompt`` also merges
groups that drew the same prompt text, as upstream's tracker does. A prompt whose rewards are all equal gets exactly 0.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import torch
from torch import Tensor

from rlpost import (
    CHAINS,
    AdvantageEstimator,
    Advantages,
    Range,
    RewardScores,
    Rollout,
    broadcast_to_edges,
    constant_groups,
    mix_rewards,
)

__all__ = ["FlowGRPOAdvantage"]


class FlowGRPOAdvantage(AdvantageEstimator):
    """Per-prompt mean, population std (global or per prompt) plus ``eps``, broadcast to each chain's trained edges.

    Args:
        eps: Added to the std (upstream 1e-4).
        global_std: Divide by the std of all rewards of the step (Flow-GRPO) instead of the prompt's (GRPO-Guard).
        group_by: ``prompt`` (upstream: samples with the same prompt text share statistics) or ``group`` (the
            rollout's prompt groups).
        mix: ``reward`` (weighted sum of raw rewards, then normalise: upstream) or ``advantage`` (normalise each
            reward, then the weighted sum).
    """

    name: ClassVar[str] = "flow-grpo"
    requires: ClassVar[frozenset[str]] = frozenset({CHAINS})

    def __init__(
        self,
        eps: Annotated[float, Range(gt=0)] = 1e-4,
        global_std: bool = True,
        group_by: Literal["prompt", "group"] = "prompt",
        mix: Literal["reward", "advantage"] = "reward",
    ) -> None:
        self.eps = float(eps)
        self.global_std = bool(global_std)
        self.group_by = group_by
        self.mix = mix

    def validate(self, recipe: Any) -> list[str]:
        """Check the choices and that groups have two samples or more."""
        problems = []
        if self.group_by not in ("prompt", "group"):
            problems.append(f"advantage.init_args.group_by: must be 'prompt' or 'group', got {self.group_by!r}")
        if self.mix not in ("reward", "advantage"):
            problems.append(f"advantage.init_args.mix: must be 'reward' or 'advantage', got {self.mix!r}")
        if recipe.run.samples_per_group < 2:
            problems.append(
                f"run.samples_per_group: flow-grpo advantages need at least 2 samples per prompt, got "
                f"{recipe.run.samples_per_group} (every advantage would be 0)"
            )
        return problems

    def sample_ids(self, rollout: Rollout) -> Tensor:
        """``[S]`` statistics group of each sample: its prompt text's index, or its prompt group."""
        if self.group_by == "group":
            return rollout.sample_group.long().cpu()
        index: dict[str, int] = {}
        return torch.tensor([index.setdefault(p, len(index)) for p in rollout.sample_prompts], dtype=torch.long)

    def estimate(self, rollout: Rollout, scores: RewardScores) -> Advantages:
        """Normalise rewards per prompt and give each trainable edge its sample's advantage."""
        ids = self.sample_ids(rollout)
        cpu = RewardScores({k: v.cpu() for k, v in scores.scores.items()}, scores.weights)
        adv = mix_rewards(cpu, ids, self.mix, self.eps, global_std=self.global_std, unbiased=False)
        flat = constant_groups(cpu.weighted_sum(), ids)
        _, first = torch.unique(ids, return_inverse=True)
        per_prompt = torch.zeros(int(first.max()) + 1, dtype=torch.bool).scatter_(0, first, flat)
        edges = broadcast_to_edges(rollout, adv)
        metrics = {
            # Upstream's zero_std_ratio: the share of prompts whose rewards are all equal (their advantages are 0).
            "adv/zero_std_frac": float(per_prompt.float().mean()),
            "adv/abs_mean": float(adv.abs().mean()),
            "adv/max": float(adv.max()),
            "adv/min": float(adv.min()),
            "adv/trainable_edges": float(rollout.trainable.sum()),
        }
        return Advantages(edges=edges, samples=adv, metrics=metrics)
