"""Flow-GRPO's update rule (arXiv 2505.05470) with GRPO-Guard's ratio normalisation (arXiv 2510.22319) as an option.

The clipped surrogate, its layout and the KL term are :class:`rlpost.ClippedSurrogate`'s; this rule changes three of
its extension points to upstream's (``yifan123/flow_grpo`` at 9745241, cited as ``@9745241``):

* **KL denominator** (``scripts/train_sd3.py``@9745241 L900-901): ``KL = mean_elem((μ_θ - μ_ref)²) / (2 s_t²)``
  with ``s_t`` the SDE's ``std_dev_t = a·sqrt(σ/(1-σ))``, *without* the ``sqrt(-dt)`` of the step std
  ``S = s_t·sqrt(-dt)`` that :meth:`Sampler.evaluate` returns. So ``s_t² = S² / (-dt)``, with
  ``-dt = σ_i - σ_{i+1}`` read from the rollout's sigmas at the edge's parent step. For CPS edges upstream's
  ``std_dev_t`` *is* the step std ``σ_{i+1}·sin(aπ/2)`` (``sd3_sde_with_logprob.py``@9745241 L71), so ``S`` is used.
* **Ratio normalisation** (``ratio_norm``, ``scripts/train_sd3_GRPO_Guard.py``@9745241 L915-932): with
  ``d̄ = mean(sqrt(-dt))`` and ``s̄ = mean(s_t)`` over the micro-batch (upstream's micro-batch is one timestep of
  several samples, so both are that step's constants and ``d̄·s̄ = S``)::

      bias  = mean((μ_θ - μ_old)²) / (2 (d̄ s̄)²)
      ratio = exp((log π_θ - log π_old + bias) · d̄ s̄)
      L_pol = clipped surrogate / d̄²

  Upstream reduces ``bias`` with ``mean(dim=tuple(range(1, logp.ndim)))`` on a ``[B]`` log-prob: the empty dim tuple
  makes PyTorch reduce over everything, so ``bias`` is **one scalar** over the micro-batch's samples and latent
  elements. ``ratio_norm_bias: batch`` (default) reproduces that per (minibatch, step) group of edges;
  ``sample`` takes each edge's own mean (the per-sample reading of the code). ``bias`` keeps its gradient, as upstream.
  Before the first update ``μ_θ = μ_old`` and ``log π_θ = log π_old``, so the ratio is 1.
* **Metrics**: upstream's ``clipfrac_gt_one`` / ``clipfrac_lt_one`` (``scripts/train_sd3.py``@9745241 L906-930).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import torch
from torch import Tensor

from rlpost import (
    EDGE_LOG_PROBS,
    EDGE_OLD_MEANS,
    ClippedSurrogate,
    EdgeEval,
    Range,
    UpdateContext,
)

__all__ = ["FlowGRPOUpdate", "RatioNormBias"]

RatioNormBias = Literal["batch", "sample"]


class FlowGRPOUpdate(ClippedSurrogate):
    """Flow-GRPO's clipped surrogate and mean-space KL over ``2 s_t²``, optionally GRPO-Guard's ratio normalisation.

    Args:
        clip_range: PPO clip ε (Flow-GRPO 1e-4; Fast/CPS 1e-5; GRPO-Guard 2e-6 OCR/GenEval, 4e-6 PickScore).
        adv_clip_max: Advantages are clamped to ±this value (5).
        kl_coef: β of the KL to the LoRA-disabled reference (pickscore_sd3 0.01; 0 in the Fast and Guard presets).
        inner_epochs: Passes over the rollout per step (upstream ``num_inner_epochs`` 1).
        optimizer_steps: Optimizer steps per pass (every SD3.5 preset: 2, ``num_batches_per_epoch /
            gradient_accumulation_steps``). Leave ``null`` when ``units_per_step`` is set.
        units_per_step: Alternative to ``optimizer_steps``: samples per optimizer step over all ranks.
        accumulation_unit: ``sample`` (upstream accumulates samples x trained timesteps into one step) or ``parent``.
        shuffle: Shuffle samples before cutting them into optimizer steps (Flow-GRPO and GRPO-Guard shuffle;
            Flow-GRPO-Fast does not).
        loss_normalisation: ``edge``: each optimizer step's loss is the mean over its edges (upstream: per
            timestep batch mean, accumulation divides by the number of micro-batch x timestep backward calls).
        minibatch_edges: Edges per forward/backward chunk (memory only).
        ratio_norm: GRPO-Guard's ratio normalisation (requires the sampler's ``record_old_means``).
        ratio_norm_bias: ``batch``: one bias per (minibatch, step) group, upstream's full reduction; ``sample``:
            each edge's own.
    """

    name: ClassVar[str] = "flow-grpo"
    requires: ClassVar[frozenset[str]] = frozenset({EDGE_LOG_PROBS})

    def __init__(
        self,
        clip_range: Annotated[float, Range(gt=0)] = 1e-4,
        adv_clip_max: Annotated[float, Range(gt=0)] = 5.0,
        kl_coef: Annotated[float, Range(ge=0)] = 0.0,
        inner_epochs: Annotated[int, Range(ge=1)] = 1,
        optimizer_steps: Annotated[int, Range(ge=1)] | None = 2,
        units_per_step: Annotated[int, Range(ge=1)] | None = None,
        accumulation_unit: Literal["parent", "sample"] = "sample",
        shuffle: bool = True,
        loss_normalisation: Literal["edge", "parent"] = "edge",
        minibatch_edges: Annotated[int, Range(ge=1)] = 64,
        ratio_norm: bool = False,
        ratio_norm_bias: RatioNormBias = "batch",
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
        self.ratio_norm = bool(ratio_norm)
        self.ratio_norm_bias = ratio_norm_bias
        if self.ratio_norm:
            # Declared per instance: only ratio normalisation needs the recorded behaviour means.
            self.requires = type(self).requires | {EDGE_OLD_MEANS}  # type: ignore[misc]

    def validate(self, recipe: Any) -> list[str]:
        """The clipped surrogate's checks, ``ratio_norm_bias``, and that ratio normalisation runs on Flow-SDE edges
        (upstream defines ``d̄`` and ``s̄`` for them only)."""
        problems = super().validate(recipe)
        if self.ratio_norm_bias not in ("batch", "sample"):
            problems.append(
                f"optimizer.init_args.ratio_norm_bias: must be 'batch' or 'sample', got {self.ratio_norm_bias!r}"
            )
        kernel = getattr(getattr(recipe, "sampler", None), "kernel", "sde")
        if self.ratio_norm and kernel != "sde":
            problems.append(
                f"optimizer.init_args.ratio_norm: GRPO-Guard's normalisation is defined for the Flow-SDE kernel "
                f"(sampler kernel 'sde'), got sampler kernel {kernel!r}"
            )
        return problems

    # ------------------------------------------------------------------------------------------------ helpers
    @staticmethod
    def neg_dt(ctx: UpdateContext, mb: Tensor, device: torch.device) -> Tensor:
        """``[B]`` fp32 ``-dt = σ_i - σ_{i+1}`` of each edge, from the rollout's sigmas and the parent's step."""
        step = ctx.rollout.edge_step[mb]
        sigmas = ctx.rollout.sigmas.to(torch.float32)
        return (sigmas[step] - sigmas[step + 1]).to(device)

    @staticmethod
    def _is_sde(ctx: UpdateContext, mb: Tensor) -> Tensor:
        names = ctx.rollout.kernels
        return torch.tensor([names[int(k)] == "flow-sde" for k in ctx.rollout.edge_kernel[mb]], dtype=torch.bool)

    # ------------------------------------------------------------------------------------- extension points
    def kl_variance(self, ctx: UpdateContext, mb: Tensor, evaluation: EdgeEval) -> Tensor:
        """``2 s_t²``: the step variance over ``-dt`` on Flow-SDE edges, the step variance itself on CPS edges."""
        std = evaluation.std.to(torch.float32)
        shape = (-1,) + (1,) * (std.ndim - 1)
        ndt = self.neg_dt(ctx, mb, std.device)
        scale = torch.where(self._is_sde(ctx, mb).to(std.device), ndt, torch.ones_like(ndt))
        return 2 * std**2 / scale.reshape(shape)

    def log_ratio(self, ctx: UpdateContext, mb: Tensor, evaluation: EdgeEval, old: Tensor) -> Tensor:
        """``log π_θ - log π_old``, or with ``ratio_norm`` GRPO-Guard's ``(log π_θ - log π_old + bias)·d̄s̄``."""
        delta = evaluation.log_prob - old
        if not self.ratio_norm:
            return delta
        if not bool(self._is_sde(ctx, mb).all()):
            raise ValueError("optimizer.init_args.ratio_norm: needs Flow-SDE edges (sampler kernel 'sde')")
        extras = ctx.rollout.edge_extras
        if EDGE_OLD_MEANS not in extras:
            raise ValueError(
                f"optimizer.init_args.ratio_norm: the rollout has no {EDGE_OLD_MEANS!r} extra; set the sampler's "
                "record_old_means: true"
            )
        device = delta.device
        old_mean = extras[EDGE_OLD_MEANS][mb].to(device, torch.float64)
        sq = ((evaluation.mean.double() - old_mean) ** 2).flatten(1).mean(1)
        ndt = self.neg_dt(ctx, mb, device).double()
        # d̄·s̄ per edge: sqrt(-dt) times s_t = S / sqrt(-dt); constant within a step, so equal to the step std S.
        scale = ndt.sqrt() * (evaluation.std.double().flatten(1)[:, 0] / ndt.sqrt())
        if self.ratio_norm_bias == "batch":
            # Upstream's empty-dim mean reduces over the micro-batch and the elements: one value per step group.
            _, group = torch.unique(ctx.rollout.edge_step[mb], return_inverse=True)
            group = group.to(device)
            n = int(group.max()) + 1
            total = torch.zeros(n, dtype=sq.dtype, device=device).index_add(0, group, sq)
            count = torch.zeros(n, dtype=sq.dtype, device=device).index_add(0, group, torch.ones_like(sq))
            sq = (total / count)[group]
        bias = sq / (2 * scale**2)
        return (delta + bias) * scale

    def surrogate_weight(self, ctx: UpdateContext, mb: Tensor, evaluation: EdgeEval) -> Tensor | float:
        """``1 / d̄² = 1 / (-dt)`` per edge with ``ratio_norm`` (GRPO-Guard's gradient reweighting), else 1."""
        if not self.ratio_norm:
            return 1.0
        return 1.0 / self.neg_dt(ctx, mb, evaluation.log_prob.device).double()

    def _ratio_metrics(self, ratios: list[tuple[Tensor, bool]]) -> dict[str, float]:
        """The clipped surrogate's ratio metrics plus upstream's one-sided clip fractions."""
        out = super()._ratio_metrics(ratios)
        if ratios:
            every = torch.cat([r for r, _ in ratios])
            out["train/clipfrac_gt_one"] = float((every - 1 > self.clip_range).double().mean())
            out["train/clipfrac_lt_one"] = float((1 - every > self.clip_range).double().mean())
        return out
