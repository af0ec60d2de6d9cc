"""The PPO/GRPO clipped-surrogate update rule shared by TreeGRPO, DanceGRPO, MixGRPO and DDPO.

Per trained edge ``e`` (algorithms.md 1.3; DDPO, DanceGRPO, Flow-GRPO and MixGRPO all use this shape)::

    ratio_e = exp(log π_θ(e) - log π_old(e))
    A_e     = clip(A_e, -adv_clip_max, adv_clip_max)
    L       = Σ_e max(-A_e · ratio_e, -A_e · clip(ratio_e, 1-ε, 1+ε)) / (edges in the optimizer step)

optionally plus ``kl_coef · KL(N(μ_θ, s²) || N(μ_ref, s²)) = kl_coef · mean_elem((μ_θ - μ_ref)²) / (2 s²)`` against the
frozen reference (Flow-GRPO's KL form, algorithms.md 5.3, with the step's own std ``s`` in the denominator: the exact
KL between the two step Gaussians).

Edges are grouped by parent node and minibatches never split a parent, so :meth:`Sampler.evaluate` runs one denoiser
forward per parent for all of its children (TreeGRPO's amortised update, algorithms.md 2.4). Gradients accumulate
over the minibatches of one optimizer step; the loss is divided by the number of edges in that step, so one step's
gradient is the mean over its edges regardless of the minibatch size.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import Tensor

from rlpost.api import PolicyOptimizer, UpdateContext

__all__ = ["ClippedSurrogate", "parent_aligned_chunks"]


def parent_aligned_chunks(parents: Tensor, num_chunks: int) -> list[Tensor]:
    """Split positions ``0..B-1`` (edges sorted so equal parents are adjacent) into ``num_chunks`` contiguous chunks
    of near-equal edge counts whose boundaries fall between parents.

    Args:
        parents: ``[B]`` parent node of each edge, equal parents adjacent.
        num_chunks: Desired number of chunks (fewer are returned when there are fewer parents).

    Returns:
        Position index tensors, one per non-empty chunk.
    """
    total = int(parents.numel())
    if total == 0:
        return []
    starts = [0] + [i for i in range(1, total) if int(parents[i]) != int(parents[i - 1])]
    bounds: list[int] = [0]
    for c in range(1, num_chunks):
        target = round(c * total / num_chunks)
        cut = min(starts, key=lambda s: abs(s - target))
        if cut > bounds[-1]:
            bounds.append(cut)
    bounds.append(total)
    return [torch.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]


class ClippedSurrogate(PolicyOptimizer):
    """PPO-style clipped surrogate over the rollout's trainable edges, with optional KL to a frozen reference.

    Args:
        clip_range: PPO clip ε on the importance ratio (1e-4 in DanceGRPO, Flow-GRPO and MixGRPO; DDPO too).
        adv_clip_max: Advantages are clipped to ±this value (5 in every anchor codebase).
        kl_coef: Weight β of the KL term to the frozen reference; 0 disables it (TreeGRPO, DanceGRPO, MixGRPO).
            A positive value needs a policy set up with ``reference: true``.
        inner_epochs: Passes over the rollout's trainable edges per step.
        optimizer_steps: Optimizer steps per pass; trainable edges are split evenly (at parent boundaries).
        minibatch_edges: Upper bound on edges per forward/backward chunk (memory); a parent's children are never
            split across chunks.
    """

    name: ClassVar[str] = "clipped-surrogate"

    def __init__(
        self,
        clip_range: float = 1e-4,
        adv_clip_max: float = 5.0,
        kl_coef: float = 0.0,
        inner_epochs: int = 1,
        optimizer_steps: int = 1,
        minibatch_edges: int = 64,
    ) -> None:
        self.clip_range = clip_range
        self.adv_clip_max = adv_clip_max
        self.kl_coef = kl_coef
        self.inner_epochs = inner_epochs
        self.optimizer_steps = optimizer_steps
        self.minibatch_edges = minibatch_edges

    def validate(self, recipe: Any) -> list[str]:
        """Check ranges and that the trainable edges per step divide into the optimizer steps."""
        problems = []
        if not self.clip_range > 0:
            problems.append(f"optimizer.init_args.clip_range: must be > 0, got {self.clip_range}")
        if not self.adv_clip_max > 0:
            problems.append(f"optimizer.init_args.adv_clip_max: must be > 0, got {self.adv_clip_max}")
        if self.kl_coef < 0:
            problems.append(f"optimizer.init_args.kl_coef: must be >= 0, got {self.kl_coef}")
        for name in ("inner_epochs", "optimizer_steps", "minibatch_edges"):
            if getattr(self, name) < 1:
                problems.append(f"optimizer.init_args.{name}: must be >= 1, got {getattr(self, name)}")
        if problems:
            return problems
        edges = recipe.counts().trainable_edges
        if edges % self.optimizer_steps:
            problems.append(
                f"optimizer.init_args.optimizer_steps: {edges} trainable edges per step do not divide into "
                f"{self.optimizer_steps} optimizer steps (change run.groups_per_step or optimizer_steps)"
            )
        return problems

    def update(self, ctx: UpdateContext) -> dict[str, float]:
        """Run ``inner_epochs`` passes of clipped-surrogate updates over the trainable edges."""
        rollout = ctx.rollout
        edges = torch.nonzero(rollout.trainable, as_tuple=False).flatten()
        if edges.numel() == 0:
            return {"train/edges": 0.0}
        adv_all = ctx.advantages.edges.to(torch.float32)
        stats: dict[str, list[float]] = {}
        first_ratio_dev = math.nan
        forwards = 0
        ctx.policy.train(True)
        for _ in range(self.inner_epochs):
            # Shuffle parents (not edges) so each minibatch holds whole sibling sets.
            parents = rollout.edge_parent[edges]
            uniq = torch.unique(parents)
            rank = torch.empty(int(parents.max()) + 1, dtype=torch.long)
            rank[uniq] = torch.randperm(uniq.numel(), generator=ctx.generator)
            order = edges[torch.argsort(rank[parents], stable=True)]
            for step_pos in parent_aligned_chunks(rollout.edge_parent[order], self.optimizer_steps):
                step_edges = order[step_pos]
                n_chunks = max(1, math.ceil(step_edges.numel() / self.minibatch_edges))
                for mb_pos in parent_aligned_chunks(rollout.edge_parent[step_edges], n_chunks):
                    mb = step_edges[mb_pos]
                    out = self._minibatch_loss(ctx, mb, adv_all[mb], step_edges.numel())
                    forwards += int(out.pop("forwards"))
                    if math.isnan(first_ratio_dev) and "ratio_dev" in out:
                        first_ratio_dev = out["ratio_dev"]
                    for k, v in out.items():
                        stats.setdefault(k, []).append(v)
                for k, v in ctx.backend.step().items():
                    stats.setdefault(k, []).append(v)
        ctx.policy.train(False)
        return self._summarise(stats, first_ratio_dev, forwards, int(edges.numel()))

    def _minibatch_loss(self, ctx: UpdateContext, mb: Tensor, adv: Tensor, step_size: int) -> dict[str, float]:
        evaluation = ctx.sampler.evaluate(ctx.policy, ctx.rollout, mb)
        old = ctx.rollout.old_log_probs[mb].to(evaluation.log_prob.device, torch.float64)
        adv = adv.to(evaluation.log_prob.device, torch.float64).clamp(-self.adv_clip_max, self.adv_clip_max)
        ratio = torch.exp(evaluation.log_prob - old)
        unclipped = -adv * ratio
        clipped = -adv * ratio.clamp(1.0 - self.clip_range, 1.0 + self.clip_range)
        policy_loss = torch.maximum(unclipped, clipped).sum() / step_size
        loss = policy_loss
        kl_value = 0.0
        ref_forwards = 0
        if self.kl_coef > 0:
            with torch.no_grad(), ctx.policy.reference():
                ref = ctx.sampler.evaluate(ctx.policy, ctx.rollout, mb)
            kl = ((evaluation.mean - ref.mean) ** 2 / (2 * evaluation.std**2)).flatten(1).mean(1)
            loss = loss + self.kl_coef * kl.sum() / step_size
            kl_value = float(kl.detach().mean())
            ref_forwards = ref.forwards
        out = {"forwards": float(evaluation.forwards), "reference_forwards": float(ref_forwards)}
        if not torch.isfinite(loss):
            # A non-finite loss never reaches backward; counted so the run's guard policy can react.
            out["nonfinite_loss"] = 1.0
            return out
        ctx.backend.backward(loss)
        with torch.no_grad():
            dlogp = evaluation.log_prob.detach() - old
            out.update(
                {
                    "policy_loss": float(policy_loss) * step_size / mb.numel(),
                    "kl": kl_value,
                    "approx_kl": float(0.5 * (dlogp**2).mean()),
                    "clipfrac": float(((ratio.detach() - 1).abs() > self.clip_range).float().mean()),
                    "ratio_mean": float(ratio.detach().mean()),
                    "ratio_min": float(ratio.detach().min()),
                    "ratio_max": float(ratio.detach().max()),
                    "ratio_dev": float((ratio.detach() - 1).abs().max()),
                }
            )
        return out

    @staticmethod
    def _summarise(stats: dict[str, list[float]], first_dev: float, forwards: int, edges: int) -> dict[str, float]:
        def mean(key: str) -> float:
            values = stats.get(key, [])
            return float(sum(values) / len(values)) if values else math.nan

        return {
            "loss/policy": mean("policy_loss"),
            "loss/kl": mean("kl"),
            "kl/approx": mean("approx_kl"),
            "train/clipfrac": mean("clipfrac"),
            "train/ratio_mean": mean("ratio_mean"),
            "train/ratio_min": min(stats.get("ratio_min", [math.nan])),
            "train/ratio_max": max(stats.get("ratio_max", [math.nan])),
            "train/first_ratio_dev": first_dev,
            "train/grad_norm": mean("train/grad_norm"),
            "train/lr": stats.get("train/lr", [math.nan])[-1],
            "train/edges": float(edges),
            "train/nonfinite_loss": float(sum(stats.get("nonfinite_loss", []))),
            "train/nonfinite_grad_steps": float(sum(stats.get("train/nonfinite_grad_steps", []))),
            "perf/train_forwards": float(forwards),
            "perf/reference_forwards": float(sum(stats.get("reference_forwards", []))),
        }
