"""TempFlow-GRPO's update rule: Flow-GRPO's clipped surrogate weighted by each step's noise level.

Per branch edge ``e`` at step ``j`` (He et al., arXiv 2508.04324, Sec. 3.2 "noise-aware policy weighting";
``Shredded-Pork/TempFlow-GRPO`` ``scripts/train_sd3_pr.py``@e66824e, ``main``'s training loop)::

    S_j   = a · sqrt(σ_j / (1 - σ_j)) · sqrt(-dt_j)          the step Gaussian's std (EdgeEval.std for flow-sde)
    ℓ_e   = c · S_j · max(-A_e · ratio_e, -A_e · clip(ratio_e, 1-ε, 1+ε))      c = 2.25 upstream
    KL_e  = mean_elem((μ_θ - μ_ref)²) / (2 S_j²)

Upstream's ``sde_step_with_logprob`` returns ``S_j`` (``std_dev_t · sqrt(-dt)``) as its fourth value and the loop
multiplies the surrogate by ``2.25 · std_dev_t`` and divides the KL by ``2 · std_dev_t²`` with it. A code comment
gives the authors' recommended alternative: return ``σ_t = a·sqrt(σ/(1-σ))`` without ``sqrt(-dt)`` and raise β
tenfold; ``noise_std: diffusion`` selects it (the weight and the KL denominator both use ``σ_t``).
Everything else (ratio, clip, advantage clamp, accumulation) is :class:`rlpost.ClippedSurrogate`.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

import torch
from torch import Tensor

from rlpost import ClippedSurrogate, EdgeEval, Range, UpdateContext

__all__ = ["TempFlowUpdate"]

NoiseStd = Literal["step", "diffusion"]


class TempFlowUpdate(ClippedSurrogate):
    """Clipped surrogate times ``weight_scale · S_j`` with the KL to the reference divided by ``2 S_j²``.

    Args:
        weight_scale: ``c`` in the per-edge factor ``c · S_j`` (upstream 2.25).
        noise_std: ``"step"`` (upstream's default): ``S_j`` is the step Gaussian's std ``σ_t·sqrt(-dt)``;
            ``"diffusion"``: the authors' commented alternative ``σ_t = S_j / sqrt(-dt)`` (pair it with a tenfold
            ``kl_coef``).
        clip_range: PPO clip ε (Flow-GRPO's base config 1e-4).
        adv_clip_max: Advantage clamp (5 upstream).
        kl_coef: β of the KL term (``pickscore_sd3_pr``: 0.001); needs a policy with a reference.
        inner_epochs: Passes over the branch edges per step (upstream 1).
        optimizer_steps: Optimizer steps per pass: upstream's 4 sampling batches with gradient accumulation 2 give
            2 per epoch.
        units_per_step: Alternative to ``optimizer_steps`` (see :class:`rlpost.ClippedSurrogate`).
        accumulation_unit: ``parent``: a trunk node's ``k`` children stay in one optimizer step (one forward).
        shuffle: Shuffle the units before cutting them into steps (upstream shuffles its rows).
        loss_normalisation: ``edge`` (upstream's per-row mean) or ``parent``.
        minibatch_edges: Upper bound on edges per forward/backward chunk (memory).
    """

    name: ClassVar[str] = "tempflow"

    def __init__(
        self,
        weight_scale: Annotated[float, Range(gt=0)] = 2.25,
        noise_std: NoiseStd = "step",
        clip_range: Annotated[float, Range(gt=0)] = 1e-4,
        adv_clip_max: Annotated[float, Range(gt=0)] = 5.0,
        kl_coef: Annotated[float, Range(ge=0)] = 0.001,
        inner_epochs: Annotated[int, Range(ge=1)] = 1,
        optimizer_steps: Annotated[int, Range(ge=1)] | None = 2,
        units_per_step: Annotated[int, Range(ge=1)] | None = None,
        accumulation_unit: Literal["parent"] = "parent",
        shuffle: bool = True,
        loss_normalisation: Literal["edge", "parent"] = "edge",
        minibatch_edges: Annotated[int, Range(ge=1)] = 64,
    ) -> None:
        super().__init__(
            clip_range=clip_range,
            adv_clip_max=adv_clip_max,
            kl_coef=kl_coef,
            inner_epochs=inner_epochs,
            optimizer_steps=optimizer_steps,
            units_per_step=units_per_step,
            accumulation_unit=accumulation_unit,
            shuffle=shuffle,
            loss_normalisation=loss_normalisation,
            minibatch_edges=minibatch_edges,
        )
        self.weight_scale = float(weight_scale)
        self.noise_std: NoiseStd = noise_std

    def validate(self, recipe: object) -> list[str]:
        """The base rule's checks plus ``noise_std``."""
        problems = super().validate(recipe)
        if self.noise_std not in ("step", "diffusion"):
            problems.append(f"optimizer.init_args.noise_std: must be 'step' or 'diffusion', got {self.noise_std!r}")
        return problems

    def noise_scale(self, ctx: UpdateContext, mb: Tensor, evaluation: EdgeEval) -> Tensor:
        """``[B, 1, …]`` fp64 ``S_j`` of each edge (or ``σ_t = S_j / sqrt(-dt_j)`` with ``noise_std: diffusion``)."""
        std = evaluation.std.to(torch.float64)
        if self.noise_std == "step":
            return std
        rollout = ctx.rollout
        step = rollout.node_step[rollout.edge_parent[mb]]
        dt = (rollout.sigmas[step] - rollout.sigmas[step + 1]).to(std.device, torch.float64)
        return std / torch.sqrt(dt).reshape(-1, *([1] * (std.ndim - 1)))

    def surrogate_weight(self, ctx: UpdateContext, mb: Tensor, evaluation: EdgeEval) -> Tensor:
        """``c · S_j`` per edge, ``[B]`` (upstream's ``2.25 * std_dev_t`` on both surrogate branches)."""
        return self.weight_scale * self.noise_scale(ctx, mb, evaluation).flatten(1)[:, 0]

    def kl_variance(self, ctx: UpdateContext, mb: Tensor, evaluation: EdgeEval) -> Tensor:
        """``2 S_j²`` (upstream's ``2 * std_dev_t ** 2``), broadcastable to ``evaluation.mean``."""
        return 2 * self.noise_scale(ctx, mb, evaluation) ** 2
