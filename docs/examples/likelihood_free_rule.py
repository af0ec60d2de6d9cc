"""A likelihood-free update rule in one file: advantage-weighted flow matching (the worked example of
``docs/writing_plugins.md``, section 7; tested in ``tests/unit/test_likelihood_free_example.py``).

Each clean sample ``x0`` of the step is re-noised at ``timesteps`` levels of the rollout's own grid,
``x_σ = (1-σ)·x0 + σ·ε``, and the live velocity is pulled towards the flow-matching target ``ε - x0`` in proportion
to the sample's advantage (pushed away for a negative one)::

    L = Σ_{i, j} A_i · mean_elem((v_θ(x_{σ_ij}, σ_ij) - (ε_ij - x0_i))²) / (S·n)  +  β · KL-like term to the reference

the core of AWM's loss (Xue et al., arXiv 2509.25050, Sec. 3) without its σ-weighted generalised Huber. It imports
only the ``rlpost`` facade, as a third-party plugin does.
"""

from __future__ import annotations

from typing import Annotated, ClassVar

import torch

from rlpost import (
    CLEAN_SAMPLES,
    REFERENCE,
    PolicyOptimizer,
    Range,
    Registry,
    StepCounts,
    TrainCounts,
    UpdateContext,
    UpdateResult,
    clean_batch,
    grid_permutations,
    hookimpl,
    noise_for,
    renoise,
)


class AdvantageWeightedFM(PolicyOptimizer):
    """Advantage-weighted flow matching on the step's clean samples.

    Args:
        timesteps: Noise levels per sample, drawn without replacement from the rollout's grid.
        kl_beta: Weight of ``mean((v_θ - v_ref)²)`` against the frozen reference (0: none, no reference forwards).
    """

    name: ClassVar[str] = "awfm-example"
    requires: ClassVar[frozenset[str]] = frozenset({CLEAN_SAMPLES})  # no edge log-probs: any solver will do

    def __init__(
        self, timesteps: Annotated[int, Range(ge=1)] = 2, kl_beta: Annotated[float, Range(ge=0)] = 0.0
    ) -> None:
        self.timesteps = timesteps
        self.kl_beta = kl_beta

    def train_counts(self, counts: StepCounts) -> TrainCounts:
        rows = counts.images * self.timesteps  # one row per (sample, noise level)
        return TrainCounts(grad_rows=rows, nograd_rows={REFERENCE: rows} if self.kl_beta > 0 else {})

    def update(self, ctx: UpdateContext) -> UpdateResult:
        batch = clean_batch(ctx)  # x0, conditioning, per-sample advantages, rank-independent keys
        sigmas = ctx.rollout.sigmas.to(batch.x0.device)
        # Keyed by (seed, step, sample): the same draws on any number of ranks and after a resume.
        levels = grid_permutations(ctx.seed, ctx.step, batch.keys, len(sigmas) - 1, self.timesteps)
        pairs = batch.size * self.timesteps
        grad_rows = ref_rows = 0
        ctx.policy.train(True)
        for j in range(self.timesteps):
            sigma = sigmas[levels[:, j]]
            shape = tuple(batch.x0.shape[1:])
            noise = torch.stack([noise_for(ctx.seed, ctx.step, key, shape, j) for key in batch.keys]).to(batch.x0)
            x_t = renoise(batch.x0, sigma, noise)
            v = ctx.policy.velocity(x_t, sigma, batch.cond, guidance=1.0)  # trained without CFG
            grad_rows += batch.size
            mse = (v - (noise - batch.x0)).pow(2).flatten(1).mean(1)
            loss = (batch.advantages * mse).sum() / pairs
            if self.kl_beta > 0:
                with torch.no_grad(), ctx.weight_copies.use(REFERENCE):
                    v_ref = ctx.policy.velocity(x_t, sigma, batch.cond, guidance=1.0)
                ref_rows += batch.size
                loss = loss + self.kl_beta * (v - v_ref).pow(2).flatten(1).mean(1).sum() / pairs
            ctx.backend.backward(loss)  # a non-finite loss is refused and counted by the backend
        metrics = ctx.backend.step()  # one optimizer step per training step
        ctx.policy.train(False)
        return UpdateResult(
            trained_edges=0, train_forwards=grad_rows, reference_forwards=ref_rows, nonfinite_losses=0, metrics=metrics
        )


@hookimpl
def rlpost_register_optimizers(register: Registry[PolicyOptimizer]) -> None:
    register(AdvantageWeightedFM)
