"""DanceGRPO's sampler (Xue et al. 2025, ``XueZeyue/DanceGRPO`` ``fastvideo/train_grpo_flux.py``), ported to the
rlpost chain core: SDE chains with DanceGRPO's step at every step, a shared initial noise per group and a per-sample
random subset of steps to train (upstream at 15cc71d; hyper-parameters in ``scripts/finetune/finetune_flux_grpo.sh``;
arXiv 2505.07818).

Time grid and last steps. Upstream (``fastvideo/train_grpo_flux.py``@15cc71d, ``run_sample_step``) samples every
step of the shifted-linspace grid ``time_shift(linspace(1, 0, T+1))`` (last nonzero level ``shift(1/T)``, 0.25 for
shift 3 and ``T = 10``) and decodes ``x̂0 = x - σ_{T-1}·v`` predicted at the last step, so the last sampled action
never reaches the reward (hence its ``--ignore_last`` flag). Here:

* ``final_step="ode"`` (default): the last step (``σ_{T-1} -> 0``) is the deterministic Euler step, whose result
  ``x - σ_{T-1}·v`` *is* that ``x̂0``; the last edge is recorded but not trainable (upstream with ``--ignore_last``).
  ``final_step="sde"`` samples the last step too (trainable unless ``ignore_last``) and decodes upstream's ``x̂0``,
  never the sampled state.
* ``penultimate_step`` is the step into the grid's last nonzero level ``σ_{T-1}``. ``"sde"`` is upstream on its
  grid: the sampled noise lands at ``σ_{T-1} = shift(1/T)`` and the ``x̂0`` prediction removes it. On the diffusers
  grid (the default ``model.init_args.time_grid``) ``σ_{T-1}`` is ``σ_min ≈ 0.009``: noise sampled into it stays in
  the image (std ``η·sqrt(σ_{T-2} - σ_min)``, ≈ 0.16 for SD3.5 at 10 steps). The default ``"ode"`` keeps that step
  deterministic, so no grid scores a noisier image than upstream (``tests/plugins/test_residual_noise.py``);
  recipes on the shifted-linspace grid set ``"sde"`` to be upstream exactly. Validation refuses ``"sde"`` on a
  model whose grid ends in ``σ_min`` (`rlpost.core.api.Policy.clean_tail_steps`).
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

__all__ = ["DanceGRPOSampler"]


class DanceGRPOSampler(Sampler):
    """Independent SDE chains with DanceGRPO's step kernel and a random subset of trained timesteps per sample.

    Args:
        num_steps: Denoising steps ``T`` (NFE per image, before CFG doubling).
        eta: ``η`` of DanceGRPO's SDE (``μ = x + dt·(v - ½η²ŝ)``, std ``η·sqrt(σ - σ')``); upstream default 0.3.
        timestep_fraction: Fraction of the eligible stochastic steps trained per sample; each sample trains the
            first ``int(n_eligible · timestep_fraction)`` steps of its own random permutation (upstream 0.6).
        init_same_noise: All samples of a group start from the same initial noise (upstream ``--init_same_noise``).
        final_step: ``"ode"``: the last step is deterministic and lands on ``x̂0`` (upstream's decoded image);
            ``"sde"``: the last step is sampled too, and upstream's ``x̂0`` of that step is decoded.
        ignore_last: With ``final_step="sde"``, keep the last step out of training (upstream ``--ignore_last``).
        penultimate_step: The step into the grid's last nonzero level: ``"ode"`` (default; deterministic, safe on
            every grid) or ``"sde"`` (sampled and trainable: upstream on the shifted-linspace grid; refused on a
            grid that ends in diffusers' ``σ_min``, where its noise would stay in the image).
        logprob_reduction: Reduce per-element log-densities by ``"mean"`` (every anchor codebase) or ``"sum"``.
        chunk_size: Maximum rows per denoiser forward during the rollout (memory budget).
    """

    name: ClassVar[str] = "dance"
    provides: ClassVar[frozenset[str]] = frozenset({CHAINS, CLEAN_SAMPLES, EDGE_LOG_PROBS})

    def __init__(
        self,
        num_steps: Annotated[int, Range(ge=2)] = 10,
        eta: Annotated[float, Range(gt=0)] = 0.3,
        timestep_fraction: Annotated[float, Range(gt=0, le=1)] = 0.6,
        init_same_noise: bool = True,
        final_step: Literal["ode", "sde"] = "ode",
        ignore_last: bool = False,
        logprob_reduction: LogProbReduction = "mean",
        chunk_size: Annotated[int, Range(ge=1)] = 16,
        penultimate_step: Literal["ode", "sde"] = "ode",
    ) -> None:
        self.num_steps = int(num_steps)
        self.eta = float(eta)
        self.timestep_fraction = float(timestep_fraction)
        self.init_same_noise = bool(init_same_noise)
        self.final_step = final_step
        self.ignore_last = bool(ignore_last)
        self.penultimate_step = penultimate_step
        self.logprob_reduction: LogProbReduction = logprob_reduction
        self.chunk_size = int(chunk_size)
        self._kernels: list[StepKernel | None] = [make_kernel("dance-sde", eta=self.eta), make_kernel("ode")]

    # ---------------------------------------------------------------------------------------------- planning
    @property
    def step_kinds(self) -> list[int]:
        """Kernel index per step: 0 (DanceGRPO's SDE) or 1 (Euler ODE) for the last two steps as configured."""
        return last_steps_kernels(self.num_steps, self.penultimate_step, self.final_step)

    @property
    def eligible(self) -> list[int]:
        """Steps a sample may train: the SDE steps, less the last one with ``ignore_last``."""
        kinds = self.step_kinds
        last = self.num_steps - 1
        return [i for i, k in enumerate(kinds) if k == 0 and not (i == last and self.ignore_last)]

    @property
    def eligible_steps(self) -> int:
        """Number of :attr:`eligible` steps (``T - 2`` by default, ``T - 1`` with ``penultimate_step="sde"``)."""
        return len(self.eligible)

    @property
    def train_steps(self) -> int:
        """Steps trained per sample: ``int(eligible_steps · timestep_fraction)`` (upstream's truncation)."""
        return int(self.eligible_steps * self.timestep_fraction)

    def validate(self, recipe: Any) -> list[str]:
        """Check that some step is trained and that the last steps suit the model's grid (the ranges of
        ``num_steps``, ``η``, ``timestep_fraction`` and ``chunk_size`` are declared on the arguments)."""
        problems = []
        if self.train_steps < 1:
            problems.append(
                f"sampler.init_args.timestep_fraction: int({self.eligible_steps} eligible steps x "
                f"{self.timestep_fraction}) = 0 steps would be trained; raise it or num_steps"
            )
        problems += last_steps_problems(self.penultimate_step, self.final_step)
        # The model adapter says where its grid turns (near-)clean (Policy.clean_tail_steps); None skips the check.
        model = getattr(recipe, "model", None)
        tail = model.clean_tail_steps() if isinstance(model, Policy) else None
        grid = getattr(model, "time_grid", None)
        if self.penultimate_step == "sde" and tail is not None and tail > 1:
            problems.append(
                f"sampler.init_args.penultimate_step: 'sde' samples the step into sigma_min (0.009 at shift 3) of "
                f"model.init_args.time_grid {grid!r}; its noise would stay in the decoded image. Use 'ode', or "
                "time_grid 'shifted-linspace' (DanceGRPO's own grid)"
            )
        if self.ignore_last and self.final_step == "ode":
            problems.append(
                "sampler.init_args.ignore_last: has no effect with final_step='ode' (the last step is "
                "already deterministic and untrained); drop it"
            )
        return problems

    def plan(self, sigmas: Tensor, num_samples: int, generator: torch.Generator) -> ChainPlan:
        """Kernels per step and each sample's random trained subset (drawn from ``generator``)."""
        t = self.num_steps
        eligible = self.eligible
        # Per sample: a random permutation of the eligible steps, keep its first train_steps
        # (upstream timestep_fraction).
        subset = random_step_subset(num_samples, len(eligible), len(eligible), self.train_steps, generator)
        trainable = torch.zeros((num_samples, t), dtype=torch.bool)
        trainable[:, eligible] = subset
        return ChainPlan(
            sigmas.cpu(),
            ["dance-sde", "ode"],
            self._kernels,
            self.step_kinds,
            trainable,
            decode_x0=self.final_step == "sde",
        )

    # --------------------------------------------------------------------------------------------- sampling
    def rollout(self, policy: Policy, batch: PromptBatch, generator: torch.Generator) -> Rollout:
        """SDE-sample ``samples_per_group`` chains per group, all chains batched together."""
        same = self.init_same_noise
        return rollout_chains(
            policy, batch, generator, self.num_steps, self.plan, same, self.chunk_size, self.logprob_reduction
        )

    def rollout_groups(self, policy: Policy, batch: PromptBatch, generators: Sequence[torch.Generator]) -> Rollout:
        """Every group's chains in one batch, group ``j`` drawing from ``generators[j]`` what :meth:`rollout` of it
        alone draws (:func:`rlpost.rollout_chains` with one generator per group)."""
        same = self.init_same_noise
        return rollout_chains(
            policy, batch, generators, self.num_steps, self.plan, same, self.chunk_size, self.logprob_reduction
        )

    def evaluate(self, policy: Policy, rollout: Rollout, edges: Tensor) -> EdgeEval:
        """Recompute the log-probs of ``edges`` with the rollout's own kernel (one forward per parent)."""
        return evaluate_edges(policy, rollout, edges, self._kernels, self.logprob_reduction)

    def counts(self, num_groups: int, samples_per_group: int) -> StepCounts:
        """``S = G·K`` images, ``S·T`` rollout forwards, ``S·int(eligible·fraction)`` trained edges (= forwards)."""
        return chain_counts(num_groups, samples_per_group, self.num_steps, self.train_steps)
