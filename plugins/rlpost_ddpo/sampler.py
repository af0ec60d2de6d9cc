"""DDPO's sampler (Black et al. 2023, ``kvablack/ddpo-pytorch`` ``scripts/train.py``) ported to rectified flow.

DDPO samples with DDIM at ``η = 1`` and trains on every step (``timestep_fraction 1.0``;
``ddpo_pytorch/diffusers_patch/ddim_with_logprob.py``, ``config/base.py``@1958463; arXiv 2305.13301). SD3.5 is a flow
model, so the stochastic step is Flow-GRPO's SDE (noise level ``a``), our port for TreeGRPO's DDPO baseline, which the
TreeGRPO paper does not describe (``docs/design.md``, "Choices where the sources are silent"). There are no shared
initial noises and no groups in DDPO: every image is an independent chain, and the advantage comes from the
per-prompt stat tracker (:mod:`rlpost_ddpo.advantage`).

Last steps and time grid. DDPO's DDIM step (η = 1) draws its noise from the DDPM posterior, whose std never exceeds
the noise level of the state it lands on, so DDPO's images hold at most the last level's noise
(``ddpo_pytorch/diffusers_patch/ddim_with_logprob.py``@1958463). Flow-GRPO's SDE has no such bound: its std
``a·sqrt(σ/(1-σ))·sqrt(σ-σ')`` is about 0.23 for SD3.5's step from 0.28 into diffusers' ``σ_min ≈ 0.009``, and the
remaining step removes only ``σ_min·v`` of it. So by default both steps into the grid's clean end are deterministic
Euler steps and not trained: ``penultimate_step="ode"`` (the step into the last nonzero level ``σ_{T-1}``) and
``final_step="ode"`` (``σ_{T-1} -> 0``, which lands on ``x̂0``; Flow-GRPO never trains it either,
``timestep_fraction 0.99``). ``penultimate_step="sde"`` is allowed on the shifted-linspace grid, whose ``σ_{T-1} =
shift(1/T)`` hides the noise; ``final_step="sde"`` (sampled, trained, the sampled state decoded) only on the diffusers
grid, where it starts from ``σ_min`` and adds noise of std ``≈ a·σ_min``. ``tests/plugins/test_residual_noise.py``
checks every default against DDIM (η = 1) on the same grid and model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal

import torch
from torch import Tensor

from rlpost import (
    CHAINS,
    CLEAN_SAMPLES,
    EDGE_LOG_PROBS,
    ChainPlan,
    EdgeEval,
    LogProbReduction,
    Policy,
    PromptBatch,
    Range,
    Rollout,
    Sampler,
    StepCounts,
    StepKernel,
    chain_counts,
    evaluate_edges,
    last_steps_kernels,
    last_steps_problems,
    make_kernel,
    random_step_subset,
    rollout_chains,
)

__all__ = ["DDPOSampler"]


class DDPOSampler(Sampler):
    """Independent Flow-GRPO SDE chains, all stochastic steps trained (DDPO's ``timestep_fraction = 1``).

    Args:
        num_steps: Denoising steps ``T``.
        noise_level: ``a`` of the Flow-GRPO SDE (``σ_t = a·sqrt(σ/(1-σ))``); 0.7 as Flow-GRPO.
        timestep_fraction: Fraction of the stochastic steps each sample trains (a random subset per sample, as
            DDPO's per-sample timestep shuffle); DDPO's default 1.0 trains them all.
        final_step: ``"ode"``: deterministic last step to ``x̂0`` (not trained); ``"sde"``: sampled and trained
            (diffusers grid only).
        penultimate_step: The step into the grid's last nonzero level: ``"ode"`` (default, not trained) or
            ``"sde"`` (sampled and trained; shifted-linspace grid only).
        logprob_reduction: ``"mean"`` (anchor convention) or ``"sum"`` over latent elements.
        chunk_size: Maximum rows per denoiser forward during the rollout (memory budget).
    """

    name: ClassVar[str] = "ddpo"
    provides: ClassVar[frozenset[str]] = frozenset({CHAINS, CLEAN_SAMPLES, EDGE_LOG_PROBS})

    def __init__(
        self,
        num_steps: Annotated[int, Range(ge=2)] = 10,
        noise_level: Annotated[float, Range(gt=0)] = 0.7,
        timestep_fraction: Annotated[float, Range(gt=0, le=1)] = 1.0,
        final_step: Literal["ode", "sde"] = "ode",
        logprob_reduction: LogProbReduction = "mean",
        chunk_size: Annotated[int, Range(ge=1)] = 16,
        penultimate_step: Literal["ode", "sde"] = "ode",
    ) -> None:
        self.num_steps = int(num_steps)
        self.noise_level = float(noise_level)
        self.timestep_fraction = float(timestep_fraction)
        self.final_step = final_step
        self.penultimate_step = penultimate_step
        self.logprob_reduction: LogProbReduction = logprob_reduction
        self.chunk_size = int(chunk_size)
        self._kernels: list[StepKernel | None] = [
            make_kernel("flow-sde", noise_level=self.noise_level),
            make_kernel("ode"),
        ]

    @property
    def step_kinds(self) -> list[int]:
        """Kernel index per step: 0 (Flow-GRPO's SDE) or 1 (Euler ODE) for the last two steps as configured."""
        return last_steps_kernels(self.num_steps, self.penultimate_step, self.final_step)

    @property
    def stochastic_steps(self) -> int:
        """Steps sampled with the SDE: ``T - 2`` by default, one more per last step set to ``"sde"``."""
        return self.step_kinds.count(0)

    @property
    def train_steps(self) -> int:
        """Steps trained per sample: ``int(stochastic_steps · timestep_fraction)``."""
        return int(self.stochastic_steps * self.timestep_fraction)

    def validate(self, recipe: Any) -> list[str]:
        """Check that some step is trained and that the last steps suit the model's grid (the ranges of
        ``num_steps``, the noise level, ``timestep_fraction`` and ``chunk_size`` are declared on the arguments)."""
        problems = []
        if self.train_steps < 1:
            problems.append(f"sampler.init_args.timestep_fraction: {self.timestep_fraction} trains 0 steps")
        problems += last_steps_problems(self.penultimate_step, self.final_step)
        # The model adapter says where its grid turns (near-)clean (Policy.clean_tail_steps); None skips the check.
        model = getattr(recipe, "model", None)
        tail = model.clean_tail_steps() if isinstance(model, Policy) else None
        grid = getattr(model, "time_grid", None)
        if tail is not None:
            # The one step that starts from a noisy level and lands on the grid's clean end must be deterministic.
            if tail > 1 and self.penultimate_step == "sde":
                problems.append(
                    f"sampler.init_args.penultimate_step: 'sde' samples the step into sigma_min (0.009 at shift 3) "
                    f"of model.init_args.time_grid {grid!r}; its noise would stay in the decoded image. Use 'ode'"
                )
            if tail == 1 and self.final_step == "sde":
                problems.append(
                    f"sampler.init_args.final_step: 'sde' samples the step from shift(1/T) to 0 of "
                    f"model.init_args.time_grid {grid!r} and decodes it; its noise would stay in the image. Use 'ode'"
                )
        return problems

    def plan(self, sigmas: Tensor, num_samples: int, generator: torch.Generator) -> ChainPlan:
        """SDE everywhere except the configured last steps (both ODE by default); the trained subset per sample."""
        step_kernel = self.step_kinds
        stochastic = [i for i, k in enumerate(step_kernel) if k == 0]
        trainable = torch.zeros((num_samples, self.num_steps), dtype=torch.bool)
        if self.train_steps == self.stochastic_steps:
            trainable[:, stochastic] = True
        else:
            trainable[:, stochastic] = random_step_subset(
                num_samples, len(stochastic), len(stochastic), self.train_steps, generator
            )
        return ChainPlan(sigmas.cpu(), ["flow-sde", "ode"], self._kernels, step_kernel, trainable)

    def rollout(self, policy: Policy, batch: PromptBatch, generator: torch.Generator) -> Rollout:
        """Sample one independent chain per image (``G·K`` images), batched."""
        return rollout_chains(
            policy, batch, generator, self.num_steps, self.plan, False, self.chunk_size, self.logprob_reduction
        )

    def rollout_groups(self, policy: Policy, batch: PromptBatch, generators: Sequence[torch.Generator]) -> Rollout:
        """Every group's chains in one batch, group ``j`` drawing from ``generators[j]`` what :meth:`rollout` of it
        alone draws (:func:`rlpost.rollout_chains` with one generator per group)."""
        return rollout_chains(
            policy, batch, generators, self.num_steps, self.plan, False, self.chunk_size, self.logprob_reduction
        )

    def evaluate(self, policy: Policy, rollout: Rollout, edges: Tensor) -> EdgeEval:
        """Recompute the log-probs of ``edges`` with the rollout's kernel (one forward per parent)."""
        return evaluate_edges(policy, rollout, edges, self._kernels, self.logprob_reduction)

    def counts(self, num_groups: int, samples_per_group: int) -> StepCounts:
        """``S = G·K`` images, ``S·T`` rollout forwards, ``S·train_steps`` trained edges (= train forwards)."""
        return chain_counts(num_groups, samples_per_group, self.num_steps, self.train_steps)
