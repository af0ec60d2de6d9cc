"""DDPO's sampler (Black et al. 2023, ``kvablack/ddpo-pytorch`` ``scripts/train.py``) ported to rectified flow.

DDPO samples with DDIM at ``η = 1`` and trains on every step (``timestep_fraction 1.0``; algorithms.md 7.1-7.4).
SD3.5 is a flow model, so the stochastic step is Flow-GRPO's SDE (algorithms.md 5.2, noise level ``a``), the port
TreeGRPO's DDPO baseline needs (algorithms.md 7.5, [inferred]). There are no shared initial noises and no groups in
DDPO: every image is an independent chain, and the advantage comes from the per-prompt stat tracker
(:mod:`rlpost_ddpo.advantage`).

Last step. Flow-GRPO's SDE at ``σ_{T-1} -> 0`` leaves noise of std ``a·σ_{T-1}/sqrt(1-σ_{T-1})`` in the final latent
(≈ 0.2 for SD3.5 at 10 steps). By default (``final_step="ode"``) the last step is the deterministic Euler step to
``x̂0`` and is not trained (Flow-GRPO also never trains it, ``timestep_fraction 0.99``); ``final_step="sde"`` samples
and trains it as well.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from rlpost.api import EdgeEval, Policy, Sampler, StepCounts
from rlpost.components.chain import (
    ChainPlan,
    random_step_subset,
    run_chains,
    shared_or_independent_noise,
)
from rlpost.contract import PromptBatch, Rollout
from rlpost.ops.kernels import LogProbReduction, StepKernel, make_kernel
from rlpost.sampling import evaluate_edges

__all__ = ["DDPOSampler"]


class DDPOSampler(Sampler):
    """Independent Flow-GRPO SDE chains, all stochastic steps trained (DDPO's ``timestep_fraction = 1``).

    Args:
        num_steps: Denoising steps ``T``.
        noise_level: ``a`` of the Flow-GRPO SDE (``σ_t = a·sqrt(σ/(1-σ))``); 0.7 as Flow-GRPO.
        timestep_fraction: Fraction of the stochastic steps each sample trains (a random subset per sample, as
            DDPO's per-sample timestep shuffle); DDPO's default 1.0 trains them all.
        final_step: ``"ode"``: deterministic last step to ``x̂0`` (not trained); ``"sde"``: sampled and trained.
        logprob_reduction: ``"mean"`` (anchor convention) or ``"sum"`` over latent elements.
        chunk_size: Maximum rows per denoiser forward during the rollout (memory budget).
    """

    name: ClassVar[str] = "ddpo"
    provides: ClassVar[frozenset[str]] = frozenset({"chains"})

    def __init__(
        self,
        num_steps: int = 10,
        noise_level: float = 0.7,
        timestep_fraction: float = 1.0,
        final_step: Literal["ode", "sde"] = "ode",
        logprob_reduction: LogProbReduction = "mean",
        chunk_size: int = 16,
    ) -> None:
        self.num_steps = int(num_steps)
        self.noise_level = float(noise_level)
        self.timestep_fraction = float(timestep_fraction)
        self.final_step = final_step
        self.logprob_reduction: LogProbReduction = logprob_reduction
        self.chunk_size = int(chunk_size)
        self._kernels: list[StepKernel | None] = [make_kernel("flow-sde", noise_level=self.noise_level),
                                                  make_kernel("ode")]

    @property
    def stochastic_steps(self) -> int:
        """Steps sampled with the SDE: ``T``, or ``T - 1`` with a deterministic last step."""
        return self.num_steps - (1 if self.final_step == "ode" else 0)

    @property
    def train_steps(self) -> int:
        """Steps trained per sample: ``int(stochastic_steps · timestep_fraction)``."""
        return int(self.stochastic_steps * self.timestep_fraction)

    def validate(self, recipe: Any) -> list[str]:
        """Check the step count, noise level, ``timestep_fraction`` and chunk size."""
        problems = []
        if self.num_steps < 2:
            problems.append(f"sampler.init_args.num_steps: must be >= 2, got {self.num_steps}")
        if not self.noise_level > 0:
            problems.append(f"sampler.init_args.noise_level: must be > 0, got {self.noise_level}")
        if not 0.0 < self.timestep_fraction <= 1.0:
            problems.append(f"sampler.init_args.timestep_fraction: must be in (0, 1], got {self.timestep_fraction}")
        elif self.num_steps >= 2 and self.train_steps < 1:
            problems.append(f"sampler.init_args.timestep_fraction: {self.timestep_fraction} trains 0 steps")
        if self.final_step not in ("ode", "sde"):
            problems.append(f"sampler.init_args.final_step: must be 'ode' or 'sde', got {self.final_step!r}")
        if self.chunk_size < 1:
            problems.append(f"sampler.init_args.chunk_size: must be >= 1, got {self.chunk_size}")
        return problems

    def plan(self, sigmas: Tensor, num_samples: int, generator: torch.Generator) -> ChainPlan:
        """SDE everywhere (ODE last step by default); the trained subset per sample."""
        step_kernel = [0] * self.num_steps
        if self.final_step == "ode":
            step_kernel[-1] = 1
        if self.train_steps == self.stochastic_steps:
            trainable = torch.zeros((num_samples, self.num_steps), dtype=torch.bool)
            trainable[:, : self.stochastic_steps] = True
        else:
            trainable = random_step_subset(num_samples, self.num_steps, self.stochastic_steps, self.train_steps,
                                           generator)
        return ChainPlan(sigmas.cpu(), ["flow-sde", "ode"], self._kernels, step_kernel, trainable)

    def rollout(self, policy: Policy, batch: PromptBatch, generator: torch.Generator) -> Rollout:
        """Sample one independent chain per image (``G·K`` images), batched."""
        s = batch.num_groups * batch.samples_per_group
        noise = shared_or_independent_noise(policy, batch.num_groups, batch.samples_per_group, generator, False)
        plan = self.plan(policy.sigmas(self.num_steps), s, generator)
        return run_chains(policy, batch, generator, plan, noise, self.chunk_size, self.logprob_reduction)

    def evaluate(self, policy: Policy, rollout: Rollout, edges: Tensor) -> EdgeEval:
        """Recompute the log-probs of ``edges`` with the rollout's kernel (one forward per parent)."""
        return evaluate_edges(policy, rollout, edges, self._kernels, self.logprob_reduction)

    def counts(self, num_groups: int, samples_per_group: int) -> StepCounts:
        """``S = G·K`` images, ``S·T`` rollout forwards, ``S·train_steps`` trained edges (= train forwards)."""
        s = num_groups * samples_per_group
        edges = s * self.train_steps
        return StepCounts(images=s, trainable_edges=edges, rollout_forwards=s * self.num_steps, train_forwards=edges)
