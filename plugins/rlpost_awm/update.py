"""AWM, Advantage Weighted Matching (Xue et al., arXiv 2509.25050, ICML 2026): the update rule ``awm``.

AWM never looks at a rollout's edges. It re-noises each clean sample ``x0`` at a few noise levels ``σ`` of the rollout
grid and trains the flow-matching loss there, weighted by the sample's advantage. Per (timestep, sample) pair, with
``x_σ = (1-σ)·x0 + σ·ε`` and ``v_θ`` the conditional velocity (guidance 1)::

    ℓ    = -mean_elem((v_θ(x_σ, σ) - (ε - x0))²)                      (fp64)
    ℓ_w  = -((-ℓ + 1e-10)^p - (1e-10)^p) · σ / p                      ('ghuber' weighting, p = ghuber_power)
    A    = clamp(A, -adv_clip_max, adv_clip_max) / adv_clip_max
    L    = -mean(A · ℓ_w) + kl_beta · mean(mean_elem((v_θ - v_ref)²)) + ema_beta · mean(mean_elem((v_θ - v_ema)²))

(scxue/advantage_weighted_matching ``advantage_weighted_matching/scripts/train_sd3_awm.py`` @be51372: ``ℓ``/``ℓ_w`` in
``compute_log_prob_awm`` L210-252, the advantage rescale L1293-1299, the KL terms L1330-1354). Upstream wraps
``ℓ_w`` in a PPO ratio ``exp(ℓ_w - sg(ℓ_w,old))`` clipped at 1 (L1301-1327), but its on-policy presets take the
"old" value as the current one detached (L1227-1229, L1282-1284), so the ratio is exactly 1 and the gradient is
``-mean(A·∇ℓ_w)``: the policy loss here is ``-mean(A·ℓ_w)``, the same gradient (``docs/algorithms/awm.md``).

Timesteps (``time_type``): the grid's step indices ``lo … int(T·max_index_fraction)`` (``lo`` = 1 for
``discrete_wo_init``, 0 for ``discrete``) cut into ``num_train_timesteps`` strata, one index drawn in each
(:func:`rlpost.stratified_indices`), the same indices for every sample of a micro-batch (upstream L1172-1205);
``σ = rollout.sigmas[index]``. The draw is keyed on ``(seed, step, first sample of the micro-batch)`` and the noise
``ε`` on ``(seed, step, sample, stratum)`` (:func:`rlpost.noise_for`), so neither depends on the number of ranks
when each rank's sample count is a multiple of ``minibatch_samples`` (ranks hold whole groups, in order), nor on a
resume. All timesteps of a micro-batch run in one batched forward (``minibatch_samples · num_train_timesteps`` rows),
as upstream (L1209-1222).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import torch
from torch import Tensor

from rlpost import (
    CLEAN_SAMPLES,
    REFERENCE,
    CleanBatch,
    PolicyOptimizer,
    Range,
    StepCounts,
    TrainCounts,
    UpdateContext,
    UpdateResult,
    clean_batch,
    keyed_generator,
    noise_for,
    renoise,
    sample_chunks,
    stratified_indices,
)

__all__ = ["EMA_COPY", "AWMUpdate", "TimeType", "awm_policy_terms"]

TimeType = Literal["discrete_wo_init", "discrete"]

EMA_COPY = "ema"
"""The weight copy the KL-EMA term evaluates (recipe section ``copies``; upstream's second LoRA adapter "ema",
L647-657, updated ``ema ← d·ema + (1-d)·θ`` with ``d = min(0.3, 0.001·step)`` after every step, L1409-1419)."""

STRATA_STREAM = 2
"""Sub-stream of the timestep draw in :func:`rlpost.keyed_generator` (``noise_for`` uses 1, ``grid_permutations``
0), so the timesteps and the noise of one step never share a stream."""

GHUBER_EPS = 1e-10
"""The offset inside upstream's generalised Huber (``compute_log_prob_awm``, L247-248)."""


def awm_policy_terms(velocity: Tensor, noise: Tensor, x0: Tensor, sigma: Tensor, power: float) -> tuple[Tensor, Tensor]:
    """Per (timestep, sample) row: the flow-matching error ``-ℓ = mean_elem((v - (ε - x0))²)`` and the weighted
    log-likelihood surrogate ``ℓ_w = -((-ℓ + 1e-10)^p - (1e-10)^p)·σ/p``, both ``[B]`` fp64.

    Args:
        velocity: ``[B, *latent]`` predicted velocity (gradients flow through it).
        noise: ``[B, *latent]`` the ``ε`` each row was noised with.
        x0: ``[B, *latent]`` clean latents.
        sigma: ``[B]`` noise level of each row.
        power: The generalised-Huber power ``p`` (upstream ``ghuber_power``).
    """
    target = noise.double() - x0.double()
    mse = (velocity.double() - target).pow(2).flatten(1).mean(1)
    eps = torch.tensor(GHUBER_EPS, dtype=torch.float64, device=mse.device)
    weighted = -((mse + eps).pow(power) - eps.pow(power)) * sigma.double().to(mse.device) / power
    return mse, weighted


class AWMUpdate(PolicyOptimizer):
    """Advantage Weighted Matching: an advantage-weighted, σ-weighted generalised-Huber flow-matching loss on the
    rollout's clean samples, with KL terms to the frozen reference and to an EMA copy. One optimizer step per
    training step; gradients accumulate over micro-batches of ``minibatch_samples`` samples.

    Args:
        kl_beta: Weight of ``mean((v_θ - v_ref)²)`` against the frozen reference (LoRA off); 0 disables it (upstream
            ``train.beta``: GenEval 0.001, OCR 0.003, PickScore 1e-4).
        ema_beta: Weight of ``mean((v_θ - v_ema)²)`` against the weight copy ``ema`` (upstream ``train.ema_beta`` 1);
            0 disables it. A positive value needs ``copies: {ema: {rate: 0.001, cap: 0.3}}`` in the recipe.
        ghuber_power: The power ``p`` of the generalised-Huber weighting (upstream ``train.ghuber_power`` 0.25).
        num_train_timesteps: Strata, hence trained timesteps per sample (upstream ``train.train_timesteps`` 6).
        time_type: ``discrete_wo_init`` (strata over step indices ``1 … int(T·f)``; GenEval, OCR) or ``discrete``
            (``0 … int(T·f)``; PickScore).
        max_index_fraction: ``f`` above (upstream ``train.timestep_fraction`` 0.9).
        adv_clip_max: Advantages are clipped to ±this and divided by it, to ``[-1, 1]`` (upstream 5, with
            ``advantage_max`` 1).
        minibatch_samples: Samples per micro-batch (upstream ``train.batch_size``: 3 GenEval/OCR, 2 PickScore):
            they share their timesteps and run in one forward of ``minibatch_samples · num_train_timesteps`` rows.
        train_guidance: Guidance of the trained velocity and of the KL velocities (upstream ``train.cfg = False``:
            the conditional branch alone, 1.0); ``null``: the adapter's configured (rollout) scale, which is what a
            guidance-distilled model such as FLUX.1-dev trains at (``docs/models.md``, "Guidance per call").
        skip_first_steps: Training steps that roll out and score but train nothing (0: the method as the paper
            states it). Upstream's loop samples and trains nothing in its first two epochs (L880-881, L936-937); set
            2 to reproduce its step numbering. A skipped step reports zero counts.
    """

    name: ClassVar[str] = "awm"
    requires: ClassVar[frozenset[str]] = frozenset({CLEAN_SAMPLES})

    def __init__(
        self,
        kl_beta: Annotated[float, Range(ge=0)] = 0.001,
        ema_beta: Annotated[float, Range(ge=0)] = 1.0,
        ghuber_power: Annotated[float, Range(gt=0, le=1)] = 0.25,
        num_train_timesteps: Annotated[int, Range(ge=1)] = 6,
        time_type: TimeType = "discrete_wo_init",
        max_index_fraction: Annotated[float, Range(gt=0, le=1)] = 0.9,
        adv_clip_max: Annotated[float, Range(gt=0)] = 5.0,
        minibatch_samples: Annotated[int, Range(ge=1)] = 3,
        train_guidance: Annotated[float, Range(ge=1)] | None = 1.0,
        skip_first_steps: Annotated[int, Range(ge=0)] = 0,
    ) -> None:
        self.kl_beta = float(kl_beta)
        self.ema_beta = float(ema_beta)
        self.ghuber_power = float(ghuber_power)
        self.num_train_timesteps = num_train_timesteps
        self.time_type = time_type
        self.max_index_fraction = float(max_index_fraction)
        self.adv_clip_max = float(adv_clip_max)
        self.minibatch_samples = minibatch_samples
        self.train_guidance = None if train_guidance is None else float(train_guidance)
        self.skip_first_steps = skip_first_steps

    # ------------------------------------------------------------------------------------------- validation

    def validate(self, recipe: Any) -> list[str]:
        """Check ``time_type`` and that the rollout grid has a step index to train: ``int(T·max_index_fraction)``
        must reach the lowest index (1 for ``discrete_wo_init``), with ``T = rollout_forwards // images``."""
        field = "optimizer.init_args."
        if self.time_type not in ("discrete_wo_init", "discrete"):
            return [f"{field}time_type: must be 'discrete_wo_init' or 'discrete', got {self.time_type!r}"]
        counts = recipe.counts()
        steps = counts.rollout_forwards // max(1, counts.images)
        lo, hi = self.index_range(steps)
        if hi < lo:
            return [
                f"{field}max_index_fraction: {self.max_index_fraction} of the sampler's {steps} steps leaves no step "
                f"index in [{lo}, int({steps}·{self.max_index_fraction}) = {hi}] to train ({self.time_type!r})"
            ]
        return []

    def index_range(self, num_steps: int) -> tuple[int, int]:
        """``(lo, hi)``: the step indices the strata cover for a grid of ``num_steps`` steps (upstream's
        ``int(num_steps · timestep_fraction)``)."""
        return (1 if self.time_type == "discrete_wo_init" else 0), int(num_steps * self.max_index_fraction)

    def required_copies(self) -> frozenset[str]:
        """``{"ema"}`` when the KL-EMA term is on."""
        return frozenset({EMA_COPY}) if self.ema_beta > 0 else frozenset()

    def train_counts(self, counts: StepCounts) -> TrainCounts:
        """Rows of a trained step: ``S·n_t`` with gradients (``S = counts.images`` samples, ``n_t`` timesteps each)
        and as many no-grad rows of the reference (``kl_beta > 0``) and of the ``ema`` copy (``ema_beta > 0``). A
        step below ``skip_first_steps`` runs none of them (its ``UpdateResult`` says 0); these are the counts of
        every other step."""
        rows = counts.images * self.num_train_timesteps
        nograd = {name: rows for name, beta in ((REFERENCE, self.kl_beta), (EMA_COPY, self.ema_beta)) if beta > 0}
        return TrainCounts(
            grad_rows=rows, nograd_rows=nograd, rows_per_call=self.minibatch_samples * self.num_train_timesteps
        )

    # ------------------------------------------------------------------------------------------------ update

    def update(self, ctx: UpdateContext) -> UpdateResult:
        """One optimizer step over every micro-batch of the rollout's clean samples (none before
        ``skip_first_steps``)."""
        if ctx.step < self.skip_first_steps:
            return UpdateResult(
                trained_edges=0,
                train_forwards=0,
                reference_forwards=0,
                nonfinite_losses=0,
                metrics={"train/skipped_step": 1.0, "train/optimizer_steps": 0.0},
            )
        batch = clean_batch(ctx)
        if batch.size == 0:
            return UpdateResult(trained_edges=0, train_forwards=0, reference_forwards=0, nonfinite_losses=0)
        num_steps = int(ctx.rollout.sigmas.numel()) - 1
        lo, hi = self.index_range(num_steps)
        if hi < lo:
            raise ValueError(
                f"optimizer.init_args.max_index_fraction: {self.max_index_fraction} of the rollout's {num_steps} steps "
                f"leaves no step index in [{lo}, {hi}] to train"
            )
        denom = batch.size * self.num_train_timesteps  # per-rank mean over (timestep, sample) pairs, as upstream
        stats: dict[str, list[float]] = {}
        counts = {"grad": 0, REFERENCE: 0, EMA_COPY: 0, "nonfinite": 0}
        ctx.policy.train(True)
        for chunk in sample_chunks(torch.arange(batch.size), self.minibatch_samples):
            self._minibatch(ctx, batch, chunk, denom, stats, counts)
        step_metrics = ctx.backend.step()
        ctx.policy.train(False)
        copies = {name: counts[name] for name in (REFERENCE, EMA_COPY) if counts[name]}
        metrics = {key: float(sum(values) / len(values)) for key, values in stats.items()}
        metrics.update(step_metrics)
        metrics["train/optimizer_steps"] = 1.0
        return UpdateResult(
            trained_edges=0,
            train_forwards=counts["grad"],
            reference_forwards=sum(copies.values()),
            nonfinite_losses=counts["nonfinite"],
            metrics=metrics,
            copy_forwards=copies,
        )

    def micro_batch_indices(self, seed: int, step: int, first_key: tuple[int, int], num_steps: int) -> Tensor:
        """``[num_train_timesteps]`` step indices of the micro-batch whose first sample has key ``first_key``."""
        lo, hi = self.index_range(num_steps)
        generator = keyed_generator(seed, step, STRATA_STREAM, *first_key)
        return stratified_indices(generator, lo, hi, self.num_train_timesteps)

    def _minibatch(
        self,
        ctx: UpdateContext,
        batch: CleanBatch,
        chunk: Tensor,
        denom: int,
        stats: dict[str, list[float]],
        counts: dict[str, int],
    ) -> None:
        """Forward and backward of one micro-batch: its ``m`` samples at ``n_t`` timesteps, rows ordered
        timestep-major (row ``j·m + i`` = stratum ``j`` of sample ``i``, as upstream's ``torch.cat`` of repeats)."""
        policy, n_t, m = ctx.policy, self.num_train_timesteps, int(chunk.numel())
        rows = chunk.repeat(n_t)
        keys = [batch.keys[int(i)] for i in chunk]
        num_steps = int(ctx.rollout.sigmas.numel()) - 1
        indices = self.micro_batch_indices(ctx.seed, ctx.step, keys[0], num_steps)
        sigma = ctx.rollout.sigmas.detach().cpu().float()[indices].repeat_interleave(m).to(policy.device)
        shape = tuple(batch.x0.shape[1:])
        noise = torch.stack([noise_for(ctx.seed, ctx.step, key, shape, j) for j in range(n_t) for key in keys])
        x0 = batch.x0[rows]
        noise = noise.to(x0.device)
        x_t = renoise(x0, sigma, noise)
        cond = batch.cond.select(rows)
        # The copies first: swapping a copy's values into the parameters in place would invalidate the autograd
        # graph of a velocity already computed with gradients.
        frozen: dict[str, Tensor] = {}
        for name, beta in ((REFERENCE, self.kl_beta), (EMA_COPY, self.ema_beta)):
            if beta > 0:
                with torch.no_grad(), ctx.weight_copies.use(name):
                    frozen[name] = policy.velocity(x_t, sigma, cond, guidance=self.train_guidance).double()
                counts[name] += int(rows.numel())
        velocity = policy.velocity(x_t, sigma, cond, guidance=self.train_guidance)
        counts["grad"] += int(rows.numel())
        mse, weighted = awm_policy_terms(velocity, noise, x0, sigma, self.ghuber_power)
        adv = batch.advantages.double().clamp(-self.adv_clip_max, self.adv_clip_max) / self.adv_clip_max
        adv = adv[chunk.to(adv.device)].repeat(n_t)
        policy_sum = -(adv * weighted).sum()
        loss = policy_sum
        kl_sums: dict[str, Tensor] = {}
        for name, beta in ((REFERENCE, self.kl_beta), (EMA_COPY, self.ema_beta)):
            if name in frozen:
                kl_sums[name] = (velocity.double() - frozen[name]).pow(2).flatten(1).mean(1).sum()
                loss = loss + beta * kl_sums[name]
        loss = loss / denom
        if not torch.isfinite(loss):
            counts["nonfinite"] += 1  # kept from backward; the run's loss guard reacts to the count
            return
        ctx.backend.backward(loss)
        with torch.no_grad():
            n = float(rows.numel())
            stats.setdefault("loss/policy", []).append(float(policy_sum) / n)
            stats.setdefault("loss/flow_matching", []).append(float(mse.mean()))
            stats.setdefault("loss/weighted_matching", []).append(float(-weighted.mean()))
            stats.setdefault("train/sigma_mean", []).append(float(sigma.double().mean()))
            for name, key in ((REFERENCE, "loss/kl"), (EMA_COPY, "loss/kl_ema")):
                if name in kl_sums:
                    stats.setdefault(key, []).append(float(kl_sums[name]) / n)
