"""The PPO/GRPO clipped-surrogate update rule shared by TreeGRPO, DanceGRPO, MixGRPO and DDPO.

Per trained edge ``e`` (the surrogate of DDPO, Black et al. arXiv 2305.13301 §4.3; DanceGRPO, Flow-GRPO and MixGRPO use
the same shape)::

    ratio_e = exp(log π_θ(e) - log π_old(e))
    A_e     = clip(A_e, -adv_clip_max, adv_clip_max)
    ℓ_e     = max(-A_e · ratio_e, -A_e · clip(ratio_e, 1-ε, 1+ε))
    L       = Σ_{e in the optimizer step} ℓ_e / D

with ``D`` the number of edges in the optimizer step (``loss_normalisation: edge``) or of parent nodes in it
(``parent``: a node's children are summed). Optionally plus ``kl_coef · KL(N(μ_θ, s²) || N(μ_ref, s²)) =
kl_coef · mean_elem((μ_θ - μ_ref)²) / (2 s²)`` per edge against the frozen reference (Flow-GRPO's KL form,
yifan123/flow_grpo ``scripts/train_sd3.py``@ac4c86e, with the step's own std ``s`` in the denominator: the exact KL
between the two step Gaussians), normalised by the same ``D``.

Layout of one update (see docs/algorithms/*.md "Differences from upstream" for each algorithm's upstream layout):

* The trainable edges are grouped into **units** that always stay together in one optimizer step:
  ``accumulation_unit: parent`` (a parent node's trainable children, so :meth:`Sampler.evaluate` runs one denoiser
  forward per parent: TreeGRPO's amortised update) or ``sample`` (all trained edges of one chain: DanceGRPO,
  MixGRPO and DDPO accumulate a sample's trained timesteps into the same optimizer step; chains only).
* Per pass (``inner_epochs`` passes) the units are shuffled (``shuffle: true``; DDPO and the official TreeGRPO code)
  or taken in rollout order (``shuffle: false``; DanceGRPO and MixGRPO iterate their samples in order) and cut into
  consecutive optimizer steps of near-equal unit counts (sizes differ by at most one unit): ``optimizer_steps`` of
  them, or as many as ``units_per_step`` units per step need (``ceil(units / units_per_step)``, counted over all
  ranks). Steps need not divide evenly: upstream's layouts do (DDPO asserts it, DanceGRPO/MixGRPO silently drop a
  remainder), rlpost spreads a remainder instead of dropping it.
* Within a step, gradients accumulate over minibatches of at most ``minibatch_edges`` edges (memory only; never
  splitting a parent); the step's loss is normalised once per optimizer step as above, so the gradient does not
  depend on the minibatch size.

With one optimizer step per pass and one pass (``optimizer_steps: 1``) every minibatch is evaluated with the weights
that produced the rollout, so the importance ratio is 1 (up to recomputation rounding) and the update is plain policy
gradient: the clip never binds. With several steps the ratio leaves 1 after the first step and the clip can bind;
``train/clipfrac_after_first`` shows it.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar, Literal, get_args

import torch
from torch import Tensor

from rlpost.components.chain import edge_sample_ids
from rlpost.core.api import EdgeEval, PolicyOptimizer, Range, UpdateContext, UpdateResult

__all__ = ["AccumulationUnit", "ClippedSurrogate", "LossNormalisation", "parent_aligned_chunks"]

AccumulationUnit = Literal["parent", "sample"]
LossNormalisation = Literal["edge", "parent"]


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
        clip_range: PPO clip ε on the importance ratio (1e-4 in DanceGRPO, Flow-GRPO, MixGRPO and DDPO).
        adv_clip_max: Advantages are clipped to ±this value (5 in every anchor codebase).
        kl_coef: Weight β of the KL term to the frozen reference; 0 disables it (TreeGRPO, DanceGRPO, MixGRPO).
            A positive value needs a policy set up with ``reference: true``.
        inner_epochs: Passes over the rollout's trainable edges per step.
        optimizer_steps: Optimizer steps per pass (units split into this many near-equal consecutive parts).
            ``1`` is the one-step layout (importance ratio 1, plain policy gradient). Leave unset (``null``) when
            ``units_per_step`` is set; with neither set, one step.
        units_per_step: Upstream-style alternative to ``optimizer_steps``: units accumulated into one optimizer step,
            counted over all ranks (upstream counts per GPU: its ``gradient_accumulation_steps × train_batch_size``
            samples times its GPU count). The pass takes ``ceil(units / units_per_step)`` near-equal steps.
        accumulation_unit: What always stays in one optimizer step: ``parent`` (a parent's trainable children) or
            ``sample`` (every trained edge of one chain; chain rollouts only).
        shuffle: Shuffle the units before cutting them into steps (``false``: rollout order, i.e. group by group).
        loss_normalisation: Divide each optimizer step's summed loss by its ``edge`` count (per-edge mean: DanceGRPO,
            MixGRPO, DDPO) or by its ``parent`` count (a parent's children summed, the mean over parents).
        minibatch_edges: Upper bound on edges per forward/backward chunk (memory); a parent's children are never
            split across chunks.
    """

    name: ClassVar[str] = "clipped-surrogate"

    def __init__(
        self,
        clip_range: Annotated[float, Range(gt=0)] = 1e-4,
        adv_clip_max: Annotated[float, Range(gt=0)] = 5.0,
        kl_coef: Annotated[float, Range(ge=0)] = 0.0,
        inner_epochs: Annotated[int, Range(ge=1)] = 1,
        optimizer_steps: Annotated[int, Range(ge=1)] | None = None,
        units_per_step: Annotated[int, Range(ge=1)] | None = None,
        accumulation_unit: AccumulationUnit = "parent",
        shuffle: bool = True,
        loss_normalisation: LossNormalisation = "edge",
        minibatch_edges: Annotated[int, Range(ge=1)] = 64,
    ) -> None:
        self.clip_range = clip_range
        self.adv_clip_max = adv_clip_max
        self.kl_coef = kl_coef
        self.inner_epochs = inner_epochs
        self.optimizer_steps = optimizer_steps
        self.units_per_step = units_per_step
        self.accumulation_unit = accumulation_unit
        self.shuffle = shuffle
        self.loss_normalisation = loss_normalisation
        self.minibatch_edges = minibatch_edges

    # ------------------------------------------------------------------------------------------- validation

    def validate(self, recipe: Any) -> list[str]:
        """Check the types and choices a Python caller may get wrong (a recipe's are type-checked; the ranges are
        declared on the arguments), and that every optimizer step of a pass gets at least one unit."""
        field = "optimizer.init_args."
        problems = []
        for name in ("inner_epochs", "minibatch_edges", "optimizer_steps", "units_per_step"):
            value = getattr(self, name)
            optional = name in ("optimizer_steps", "units_per_step")
            if optional and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                allowed = "an integer >= 1" + (" or null" if optional else "")
                problems.append(f"{field}{name}: must be {allowed}, got {value!r}")
        if self.optimizer_steps is not None and self.units_per_step is not None:
            problems.append(
                f"{field}units_per_step: set either optimizer_steps ({self.optimizer_steps}) or units_per_step "
                f"({self.units_per_step}), not both (set the other to null)"
            )
        if self.accumulation_unit not in get_args(AccumulationUnit):
            problems.append(
                f"{field}accumulation_unit: must be one of {list(get_args(AccumulationUnit))}, "
                f"got {self.accumulation_unit!r}"
            )
        if self.loss_normalisation not in get_args(LossNormalisation):
            problems.append(
                f"{field}loss_normalisation: must be one of {list(get_args(LossNormalisation))}, "
                f"got {self.loss_normalisation!r}"
            )
        if not isinstance(self.shuffle, bool):
            problems.append(f"{field}shuffle: must be true or false, got {self.shuffle!r}")
        if problems:
            return problems
        counts = recipe.counts()
        if self.accumulation_unit == "sample" and counts.trainable_edges > counts.train_forwards:
            # More trained edges than training forwards means some parent has several trained children: a tree.
            problems.append(
                f"{field}accumulation_unit: 'sample' needs chain rollouts, but this sampler trains "
                f"{counts.trainable_edges} edges from {counts.train_forwards} parents (a tree); use 'parent'"
            )
            return problems
        units = counts.images if self.accumulation_unit == "sample" else counts.train_forwards
        steps = self.steps_per_pass(units)
        if steps > units:
            which = "optimizer_steps" if self.optimizer_steps is not None else "units_per_step"
            problems.append(
                f"{field}{which}: {steps} optimizer steps per pass but only {units} {self.accumulation_unit} units "
                f"per training step (every optimizer step needs at least one)"
            )
        return problems

    def reference_forwards_per_train_forward(self) -> int:
        """One reference evaluation of each minibatch when the KL term is on (``_minibatch_loss``), else none."""
        return 1 if self.kl_coef > 0 else 0

    def steps_per_pass(self, global_units: int) -> int:
        """Optimizer steps per pass for ``global_units`` units in the step (summed over ranks)."""
        if self.units_per_step is not None:
            return max(1, math.ceil(global_units / self.units_per_step))
        return 1 if self.optimizer_steps is None else self.optimizer_steps

    # ------------------------------------------------------------------------------------------------ update

    def _edge_units(self, ctx: UpdateContext, edges: Tensor) -> Tensor:
        """``[B]`` unit id of each trainable edge; ids increase in rollout order."""
        rollout = ctx.rollout
        if self.accumulation_unit == "parent":
            return rollout.edge_parent[edges]
        if rollout.is_branching():
            raise ValueError(
                "optimizer.init_args.accumulation_unit: 'sample' needs chain rollouts, but this rollout branches "
                "(a tree: an inner edge leads to several samples); use 'parent'"
            )
        owner = edge_sample_ids(rollout)[edges]
        # An edge reaching no decoded sample (none in the shipped samplers) becomes a unit of its own.
        return torch.where(owner >= 0, owner, rollout.num_samples + rollout.edge_parent[edges])

    def _plan(self, ctx: UpdateContext, edges: Tensor, units: Tensor) -> list[Tensor]:
        """One pass: the edge ids of each optimizer step, units kept together, (optionally) shuffled."""
        uniq, inverse = torch.unique(units, return_inverse=True)
        n_units = int(uniq.numel())
        steps = self.steps_per_pass(n_units * ctx.backend.world_size)
        if steps > n_units:
            which = "optimizer_steps" if self.optimizer_steps is not None else "units_per_step"
            raise ValueError(
                f"optimizer.init_args.{which}: {steps} optimizer steps per pass but this rank holds only {n_units} "
                f"{self.accumulation_unit} units (every optimizer step needs at least one)"
            )
        # rank[u] = position of unit u in this pass (one randperm draw per pass when shuffling).
        rank = torch.randperm(n_units, generator=ctx.generator) if self.shuffle else torch.arange(n_units)
        edge_rank = rank[inverse]
        order = torch.argsort(edge_rank, stable=True)  # units in (shuffled) order, a unit's edges in rollout order
        ordered_edges, ordered_rank = edges[order], edge_rank[order]
        plan = []
        for unit_block in torch.tensor_split(torch.arange(n_units), steps):
            lo, hi = int(unit_block[0]), int(unit_block[-1])
            plan.append(ordered_edges[(ordered_rank >= lo) & (ordered_rank <= hi)])
        return plan

    def update(self, ctx: UpdateContext) -> UpdateResult:
        """Run ``inner_epochs`` passes of clipped-surrogate updates over the trainable edges."""
        rollout = ctx.rollout
        edges = torch.nonzero(rollout.trainable, as_tuple=False).flatten()
        if edges.numel() == 0:
            return UpdateResult(trained_edges=0, train_forwards=0, reference_forwards=0, nonfinite_losses=0)
        adv_all = ctx.advantages.edges.to(torch.float32)
        units = self._edge_units(ctx, edges)
        stats: dict[str, list[float]] = {}
        ratios: list[tuple[Tensor, bool]] = []  # (ratios of a minibatch, evaluated after the first optimizer step)
        first_ratio_dev = math.nan
        forwards = 0
        optimizer_steps = 0
        ctx.policy.train(True)
        for _ in range(self.inner_epochs):
            for step_edges in self._plan(ctx, edges, units):
                # A parent's edges are adjacent (parent units) or unique (chains), so minibatches can be cut at
                # parent boundaries: one forward per parent.
                parents = rollout.edge_parent[step_edges]
                denom = step_edges.numel() if self.loss_normalisation == "edge" else int(torch.unique(parents).numel())
                n_chunks = max(1, math.ceil(step_edges.numel() / self.minibatch_edges))
                for mb_pos in parent_aligned_chunks(parents, n_chunks):
                    mb = step_edges[mb_pos]
                    out, ratio = self._minibatch_loss(ctx, mb, adv_all[mb], denom)
                    forwards += int(out.pop("forwards"))
                    if ratio is not None:
                        ratios.append((ratio, optimizer_steps > 0))
                        if math.isnan(first_ratio_dev):
                            first_ratio_dev = float((ratio - 1).abs().max())
                    for k, v in out.items():
                        stats.setdefault(k, []).append(v)
                for k, v in ctx.backend.step().items():
                    stats.setdefault(k, []).append(v)
                optimizer_steps += 1
        ctx.policy.train(False)
        metrics = self._summarise(stats, first_ratio_dev)
        metrics.update(self._ratio_metrics(ratios))
        metrics["train/optimizer_steps"] = float(optimizer_steps)
        return UpdateResult(
            trained_edges=int(edges.numel()),
            train_forwards=forwards,
            reference_forwards=int(sum(stats.get("reference_forwards", []))),
            nonfinite_losses=int(sum(stats.get("nonfinite_loss", []))),
            metrics=metrics,
        )

    def _minibatch_loss(
        self, ctx: UpdateContext, mb: Tensor, adv: Tensor, denom: int
    ) -> tuple[dict[str, float], Tensor | None]:
        evaluation = ctx.sampler.evaluate(ctx.policy, ctx.rollout, mb)
        old = ctx.rollout.old_log_probs[mb].to(evaluation.log_prob.device, torch.float64)
        adv = adv.to(evaluation.log_prob.device, torch.float64).clamp(-self.adv_clip_max, self.adv_clip_max)
        ratio = torch.exp(self.log_ratio(ctx, mb, evaluation, old))
        unclipped = -adv * ratio
        clipped = -adv * ratio.clamp(1.0 - self.clip_range, 1.0 + self.clip_range)
        per_edge = torch.maximum(unclipped, clipped) * self.surrogate_weight(ctx, mb, evaluation)
        loss = per_edge.sum() / denom
        kl_value = 0.0
        ref_forwards = 0
        if self.kl_coef > 0:
            with torch.no_grad(), ctx.policy.reference():
                ref = ctx.sampler.evaluate(ctx.policy, ctx.rollout, mb)
            kl = ((evaluation.mean - ref.mean) ** 2 / self.kl_variance(ctx, mb, evaluation)).flatten(1).mean(1)
            loss = loss + self.kl_coef * kl.sum() / denom
            kl_value = float(kl.detach().mean())
            ref_forwards = ref.forwards
        out = {"forwards": float(evaluation.forwards), "reference_forwards": float(ref_forwards)}
        if not torch.isfinite(loss):
            # A non-finite loss never reaches backward; counted so the run's guard policy can react.
            out["nonfinite_loss"] = 1.0
            return out, None
        ctx.backend.backward(loss)
        with torch.no_grad():
            dlogp = evaluation.log_prob.detach() - old
            out.update(
                {
                    "policy_loss": float(per_edge.detach().mean()),
                    "kl": kl_value,
                    "approx_kl": float(0.5 * (dlogp**2).mean()),
                }
            )
        return out, ratio.detach().to("cpu", torch.float64).flatten()

    # ------------------------------------------------------------------------ extension points (subclasses)

    def log_ratio(self, ctx: UpdateContext, mb: Tensor, evaluation: EdgeEval, old: Tensor) -> Tensor:
        """``[B]`` log importance ratio of the minibatch's edges; the ratio is its exponential.

        The default is ``log π_θ(e) - log π_old(e)``. A subclass may reshape it (GRPO-Guard's ratio normalisation,
        arXiv 2510.22319) from ``evaluation`` and the rollout's per-edge extras.
        """
        return evaluation.log_prob - old

    def surrogate_weight(self, ctx: UpdateContext, mb: Tensor, evaluation: EdgeEval) -> Tensor | float:
        """Per-edge factor ``[B]`` (or a scalar) multiplying the clipped surrogate ``ℓ_e``; the default is 1.

        A subclass may weight edges by their noise level (TempFlow-GRPO, arXiv 2508.04324).
        """
        return 1.0

    def kl_variance(self, ctx: UpdateContext, mb: Tensor, evaluation: EdgeEval) -> Tensor:
        """Denominator of the mean-space KL ``mean_elem((μ_θ - μ_ref)² / kl_variance)``, broadcastable to
        ``evaluation.mean``.

        The default ``2 s²`` with ``s`` the step Gaussian's own std is the exact KL between the two step Gaussians;
        Flow-GRPO divides by ``2 s_t²`` without the ``sqrt(-dt)`` factor of the step std (a subclass's choice).
        """
        return 2 * evaluation.std**2

    def _ratio_metrics(self, ratios: list[tuple[Tensor, bool]]) -> dict[str, float]:
        """Clip fraction and ratio spread over every evaluated edge; ``*_after_first`` only when a later step ran."""
        if not ratios:
            return {}
        every = torch.cat([r for r, _ in ratios])
        clipped = (every - 1).abs() > self.clip_range
        out = {
            "train/clipfrac": float(clipped.double().mean()),
            "train/ratio_mean": float(every.mean()),
            "train/ratio_std": float(every.std(unbiased=False)),
            "train/ratio_min": float(every.min()),
            "train/ratio_max": float(every.max()),
        }
        later = [r for r, after in ratios if after]
        if later:
            rest = torch.cat(later)
            out["train/clipfrac_after_first"] = float(((rest - 1).abs() > self.clip_range).double().mean())
            out["train/ratio_std_after_first"] = float(rest.std(unbiased=False))
        return out

    @staticmethod
    def _summarise(stats: dict[str, list[float]], first_dev: float) -> dict[str, float]:
        def mean(key: str) -> float:
            values = stats.get(key, [])
            return float(sum(values) / len(values)) if values else math.nan

        return {
            "loss/policy": mean("policy_loss"),
            "loss/kl": mean("kl"),
            "kl/approx": mean("approx_kl"),
            "train/clipfrac": math.nan,
            "train/ratio_mean": math.nan,
            "train/ratio_std": math.nan,
            "train/ratio_min": math.nan,
            "train/ratio_max": math.nan,
            "train/first_ratio_dev": first_dev,
            "train/grad_norm": mean("train/grad_norm"),
            "train/lr": stats.get("train/lr", [math.nan])[-1],
        }
