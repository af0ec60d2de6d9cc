"""DiffusionNFT's update rule (Zheng et al., arXiv 2509.16117): forward-process negative-aware fine-tuning on the
clean samples of a rollout drawn with the lagging "old" weights.

Per training step, on this rank's samples (NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py`` @24af555 L797-1039):

1. each sample's optimality weight ``r`` from its clipped advantage (:func:`rlpost.optimality_weight`);
2. per sample an independent random permutation of the rollout grid's ``T`` step indices, of which the first
   ``keep = int(T · timestep_fraction)`` are trained (9 of 10 in every upstream preset;
   :func:`rlpost.grid_permutations`, keyed by the run seed, the step and the sample's global key);
3. for each (sample, kept index ``i``): ``t = σ_i`` of the rollout's grid (upstream: the shifted scheduler timestep
   / 1000), fresh ``ε`` (:func:`rlpost.noise_for`, keyed by the sample and ``i``), ``x_t = (1-t)·x0 + t·ε``, and three
   velocities at ``x_t`` at guidance ``train_guidance``: the "old" copy's and the frozen reference's without gradient
   (the reference only when ``kl_beta > 0``), the live policy's with;
4. the loss of :func:`rlpost.nft_loss`, averaged over every (sample, timestep) pair of the step (upstream
   divides each micro-batch mean by ``gradient_accumulation_steps × keep``), accumulated over minibatches of
   ``minibatch_samples`` samples (memory only: each pass evaluates one kept timestep of each sample of the minibatch,
   upstream's micro-batch per timestep), then one optimizer step.

The old copy is the recipe's ``copies.old`` (``rlpost/engine/weight_copies.py``): the rollout runs under it
(:meth:`NFTUpdate.rollout_copy`) and after every step the runner soft-updates it towards the live weights.
``docs/algorithms/nft.md`` compares this with upstream.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar

import torch
from torch import Tensor

from rlpost import (
    CLEAN_SAMPLES,
    REFERENCE,
    CleanBatch,
    Conditioning,
    Policy,
    PolicyOptimizer,
    Range,
    StepCounts,
    TrainCounts,
    UpdateContext,
    UpdateResult,
    clean_batch,
    grid_permutations,
    nft_loss,
    noise_for,
    optimality_weight,
    renoise,
    sample_chunks,
)

__all__ = ["OLD", "NFTUpdate"]

OLD = "old"
"""The weight copy DiffusionNFT samples with and contrasts the live policy against (recipe section ``copies``)."""


class NFTUpdate(PolicyOptimizer):
    """DiffusionNFT: the implicit positive/negative flow-matching loss on re-noised clean samples.

    Two different betas meet here; upstream names both ``beta``:

    Args:
        beta: NFT's guidance strength β of the implicit policies ``v±`` (upstream ``config.beta``: 1.0 in the
            GenEval, PickScore and HPSv2 presets, 0.1 in the OCR and multi-reward ones); the policy term is divided
            by it.
        kl_beta: Weight of the KL term ``mean (v_θ - v_ref)²`` to the frozen reference (upstream
            ``config.train.beta``, 1e-4 in every preset); 0 drops the term and the reference forwards.
        adv_clip_max: Advantages are clipped to ±this value before ``r = A/(2·adv_clip_max) + 1/2``, and the policy
            term is multiplied by it (upstream ``config.train.adv_clip_max``, 5).
        timestep_fraction: Each sample trains ``int(T · timestep_fraction)`` of the rollout grid's ``T`` steps
            (upstream ``config.train.timestep_fraction``, 0.99: 9 of 10).
        minibatch_samples: Samples per forward/backward pass (memory only: the gradient does not depend on it beyond
            rounding); each pass evaluates one kept timestep of each of them (upstream's per-GPU batch, 9).
        train_guidance: Guidance of the three training velocities (``Policy.velocity(..., guidance=...)``): 1.0 is
            the conditional branch alone, upstream's CFG-free training; ``null`` uses the model's configured
            (rollout) guidance, which a guidance-distilled model (FLUX.1-dev, whose guidance is an embedding input)
            needs to train the velocity it samples with.
    """

    name: ClassVar[str] = "nft"
    requires: ClassVar[frozenset[str]] = frozenset({CLEAN_SAMPLES})

    def __init__(
        self,
        beta: Annotated[float, Range(gt=0)] = 1.0,
        kl_beta: Annotated[float, Range(ge=0)] = 1e-4,
        adv_clip_max: Annotated[float, Range(gt=0)] = 5.0,
        timestep_fraction: Annotated[float, Range(gt=0, le=1)] = 0.99,
        minibatch_samples: Annotated[int, Range(ge=1)] = 9,
        train_guidance: Annotated[float, Range(ge=1)] | None = 1.0,
    ) -> None:
        self.beta = beta
        self.kl_beta = kl_beta
        self.adv_clip_max = adv_clip_max
        self.timestep_fraction = timestep_fraction
        self.minibatch_samples = minibatch_samples
        self.train_guidance = train_guidance

    # ------------------------------------------------------------------------------------------------ contract

    def kept_timesteps(self, num_steps: int) -> int:
        """Timesteps trained per sample on a ``num_steps``-step grid: ``int(num_steps · timestep_fraction)``
        (upstream's truncation)."""
        return int(num_steps * self.timestep_fraction)

    def required_copies(self) -> frozenset[str]:
        """The ``old`` copy (recipe section ``copies``)."""
        return frozenset({OLD})

    def rollout_copy(self, step: int) -> str | None:
        """Every rollout samples with the ``old`` copy (upstream ``set_adapter("old")`` around the pipeline)."""
        return OLD

    def train_counts(self, counts: StepCounts) -> TrainCounts:
        """``S·keep`` rows with gradients and as many no-grad rows of ``old`` (and of ``reference`` when
        ``kl_beta > 0``), ``minibatch_samples`` rows per call.

        ``T`` is read from the sampler's counts as ``rollout_forwards // images``: a chain sampler (``solver``, one
        denoiser row per sample per grid step) rolls out ``S·T`` rows. :meth:`validate` refuses a sampler for which
        that does not hold; at update time ``T`` is the rollout's own grid length.
        """
        images = counts.images
        grid = counts.rollout_forwards // images if images else 0
        rows = images * self.kept_timesteps(grid)
        nograd = {OLD: rows, REFERENCE: rows if self.kl_beta > 0 else 0}
        return TrainCounts(
            grad_rows=rows,
            nograd_rows={k: v for k, v in nograd.items() if v},
            rows_per_call=min(self.minibatch_samples, images),
        )

    def validate(self, recipe: Any) -> list[str]:
        """Check that the sampler rolls out one chain of ``T`` rows per sample on its grid (what :meth:`train_counts`
        reads), that some timestep is trained, and that a KL term has a reference to evaluate."""
        field = "optimizer.init_args."
        problems = []
        counts = recipe.counts()
        sampler = getattr(recipe.sampler, "name", type(recipe.sampler).__name__)
        steps = getattr(recipe.sampler, "num_steps", None)
        grid = counts.rollout_forwards // counts.images if counts.images > 0 else 0
        known = isinstance(steps, int) and not isinstance(steps, bool)
        if grid < 1 or counts.rollout_forwards % counts.images or (known and steps != grid):
            on_grid = f" on a {steps}-step grid" if known else ""
            problems.append(
                f"sampler: {sampler!r} rolls out {counts.rollout_forwards} denoiser rows for {counts.images} samples"
                f"{on_grid}; nft counts one row per sample per grid step (a chain sampler such as 'solver')"
            )
            return problems
        if self.kept_timesteps(grid) < 1:
            problems.append(
                f"{field}timestep_fraction: int({grid} steps x {self.timestep_fraction}) = 0 timesteps would be "
                "trained; raise it"
            )
        model = recipe.model
        if self.kl_beta > 0 and getattr(model, "full_finetune", False) and not getattr(model, "use_reference", True):
            problems.append(
                f"{field}kl_beta: {self.kl_beta} needs a frozen reference, but the model is fully fine-tuned without "
                "one; set model.init_args.reference: true, or kl_beta: 0"
            )
        return problems

    # -------------------------------------------------------------------------------------------------- update

    def update(self, ctx: UpdateContext) -> UpdateResult:
        """One step of DiffusionNFT on this rank's samples, one optimizer step (the module docstring)."""
        batch = clean_batch(ctx)
        grid = int(ctx.rollout.sigmas.numel()) - 1
        keep = self.kept_timesteps(grid)
        if batch.size == 0 or keep < 1:
            return UpdateResult(trained_edges=0, train_forwards=0, reference_forwards=0, nonfinite_losses=0)
        slots = grid_permutations(ctx.seed, ctx.step, batch.keys, grid, keep)  # [S, keep] grid indices
        sigmas = ctx.rollout.sigmas.detach().to(torch.float32).cpu()
        r = optimality_weight(batch.advantages, self.adv_clip_max)
        pairs = batch.size * keep
        stats: dict[str, float] = {}
        nonfinite = 0
        ctx.policy.train(True)
        try:
            for chunk in sample_chunks(torch.arange(batch.size), self.minibatch_samples):
                nonfinite += self._chunk(ctx, batch, chunk, slots[chunk], sigmas, r[chunk], pairs, stats)
            step_metrics = ctx.backend.step()
        finally:
            ctx.policy.train(False)
        with_ref = self.kl_beta > 0
        adv = batch.advantages
        rows = stats.pop("rows", 0.0)
        names = ["loss/total", "loss/policy", "loss/positive", "loss/negative", "loss/kl", "train/old_deviate"]
        names += ["kl/old_ref"] if with_ref else []
        # Means over the (sample, timestep) pairs whose loss was finite; NaN when none was.
        metrics = {k: stats[k] / rows if rows else math.nan for k in names}
        if not with_ref:
            metrics["loss/kl"] = 0.0
        metrics.update(
            {
                "train/optimality_r_mean": float(r.mean()),
                "train/optimality_r_min": float(r.min()),
                "train/optimality_r_max": float(r.max()),
                "train/adv_clipped_frac": float((adv.abs() > self.adv_clip_max).float().mean()),
                "train/x0_norm": float(batch.x0.pow(2).mean()),
                "train/timesteps_per_sample": float(keep),
                "train/pairs": float(pairs),
                "train/optimizer_steps": 1.0,
                "train/grad_norm": float(step_metrics.get("train/grad_norm", math.nan)),
                "train/lr": float(step_metrics.get("train/lr", math.nan)),
            }
        )
        copies = {OLD: pairs, REFERENCE: pairs if with_ref else 0}
        return UpdateResult(
            trained_edges=0,  # a likelihood-free rule trains re-noised samples, no rollout edges
            train_forwards=pairs,
            reference_forwards=sum(copies.values()),
            nonfinite_losses=nonfinite,
            metrics=metrics,
            copy_forwards={k: v for k, v in copies.items() if v},
        )

    def _velocity(self, policy: Policy, x: Tensor, t: Tensor, cond: Conditioning) -> Tensor:
        return policy.velocity(x, t, cond, guidance=self.train_guidance)

    def _chunk(
        self,
        ctx: UpdateContext,
        batch: CleanBatch,
        chunk: Tensor,
        slots: Tensor,
        sigmas: Tensor,
        r: Tensor,
        pairs: int,
        stats: dict[str, float],
    ) -> int:
        """Forward/backward of one minibatch of samples at each of their kept timesteps; adds the summed metrics to
        ``stats`` and returns the number of non-finite losses kept from ``backward``.

        The copies' velocities at every kept timestep of the minibatch come first, each copy swapped in once per
        minibatch: a swap copies the whole trainable set in and back (the transformer, under full fine-tuning).
        """
        policy, device = ctx.policy, ctx.policy.device
        x0 = batch.x0[chunk]
        cond = batch.cond.select(chunk)
        keys = [batch.keys[int(i)] for i in chunk]
        ts, xts = [], []
        for j in range(slots.shape[1]):
            index = slots[:, j]
            shape = x0.shape[1:]
            noise = torch.stack(
                [noise_for(ctx.seed, ctx.step, k, shape, int(i)) for k, i in zip(keys, index, strict=True)]
            )
            t = sigmas[index].to(device)
            ts.append(t)
            xts.append(renoise(x0, t, noise.to(device)))
        with torch.no_grad():
            with ctx.weight_copies.use(OLD):
                v_old = [self._velocity(policy, x, t, cond) for x, t in zip(xts, ts, strict=True)]
            v_ref: list[Tensor | None] = [None] * len(xts)
            if self.kl_beta > 0:
                with ctx.weight_copies.use(REFERENCE):
                    v_ref = [self._velocity(policy, x, t, cond) for x, t in zip(xts, ts, strict=True)]
        nonfinite = 0
        for x_t, t, old, ref in zip(xts, ts, v_old, v_ref, strict=True):
            v = self._velocity(policy, x_t, t, cond)
            terms = nft_loss(
                v, old, x0, x_t, t, r, beta=self.beta, adv_clip_max=self.adv_clip_max, v_ref=ref, kl_beta=self.kl_beta
            )
            loss = terms.total.sum() / pairs
            if not torch.isfinite(loss):
                nonfinite += 1  # never reaches backward; the runner's loss guard counts it
                continue
            ctx.backend.backward(loss)
            with torch.no_grad():
                stats["rows"] = stats.get("rows", 0.0) + float(v.shape[0])
                self._add(stats, "loss/total", terms.total)
                self._add(stats, "loss/policy", terms.policy)
                self._add(stats, "loss/positive", terms.positive)
                self._add(stats, "loss/negative", terms.negative)
                self._add(stats, "loss/kl", terms.kl)
                self._add(stats, "train/old_deviate", (v.detach() - old).pow(2).flatten(1).mean(1))
                if ref is not None:
                    self._add(stats, "kl/old_ref", (old - ref).pow(2).flatten(1).mean(1))
        return nonfinite

    @staticmethod
    def _add(stats: dict[str, float], key: str, rows: Tensor) -> None:
        stats[key] = stats.get(key, 0.0) + float(rows.detach().double().sum())
