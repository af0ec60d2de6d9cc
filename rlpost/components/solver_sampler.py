"""The built-in rollout sampler of likelihood-free update rules (DiffusionNFT, AWM, DGPO): ``G·K`` independent chains
run by a plain ODE solver, or by the ODE with noise injected in a band of noise levels, on the chain core
(:mod:`rlpost.components.chain`).

A likelihood-free rule trains on the clean samples a rollout ends in, never on its transitions, so no edge is
trainable and :meth:`SolverSampler.evaluate` stays the base class's (the sampler provides ``clean-samples`` and
``chains``, not ``edge-log-probs``). The three solvers and their upstream counterparts:

* ``euler``: the deterministic Euler step of the probability-flow ODE at every step (diffusers'
  ``FlowMatchEulerDiscreteScheduler.step``), what DGPO rolls out with (``Luo-Yihong/DGPO``
  ``scripts/train_sd3_dgpo.py``@01ceb4b L795-879, ``noise_level`` 0).
* ``dpm-solver++2``: deterministic multistep DPM-Solver++ (2M, data prediction; :func:`rlpost.dpm_solver_pp2_step`),
  DiffusionNFT's ``solver="dpm2"`` (``NVlabs/DiffusionNFT`` ``scripts/train_nft_sd3.py``@24af555 L640-677, which
  calls ``run_sampling`` with ``determistic=True`` from ``flow_grpo/diffusers_patch/solver.py``@24af555). That
  ``dpm2`` is the same update, not an approximation of it: with ``x̂0 = x - σ·v``, ``α = 1-σ`` and
  ``λ = log α - log σ``, its first step is DDIM at ``η = 0`` (``(1-σ')·x̂0 + σ'·ε̂``, algebraically DPM-Solver++'s
  order-1 step), its middle steps are ``multistep_dpm_solver_second_order_update`` (``D1 = (x̂0 - x̂0_prev)/r0``,
  ``r0 = h_prev/h``, the correction ``-½·α'·(e^{-h}-1)·D1``, our order-2 formula term for term), its last step
  (``lower_order_final``) is DDIM at ``η = 0`` to ``σ' = 0``, i.e. ``x̂0``, as ours. Its ``lower_order_second`` flag
  only matters for order 3. The one difference is arithmetic: upstream forms the coefficients from fp64 sigmas, we
  from fp32 (``rlpost/ops/dpm_solver.py``), a rounding-level difference. On a grid starting at ``σ = 1``
  (``λ = -∞``) the second step's correction vanishes (``r0 = ∞``) in both, so order 2 takes effect from the third
  step on.
* ``sde-band``: a **stand-in** for AWM's rollout, which is SA-Solver (stochastic Adams predictor-corrector,
  predictor and corrector order 2, PEC mode) with stochasticity ``τ(t) = noise_level`` for ``0.3 ≤ t ≤ 0.9`` and 0
  elsewhere (``scxue/advantage_weighted_matching``
  ``advantage_weighted_matching/flow_grpo/diffusers_patch/sd3_pipeline_with_logprob.py``@be51372 L271-332). We do
  not port SA-Solver: the steps that land on a level inside the band ``[lo, hi]`` (SA-Solver evaluates ``τ`` at the
  step's target time, ``diffusers_patch/sa_solver.py``@be51372 ``sample``) take Flow-GRPO's first-order SDE step
  (:class:`rlpost.ops.kernels.FlowGRPOSDE` with ``noise_level`` as its ``a``), every other step the Euler ODE. So the
  stand-in is first order, its noise level means Flow-GRPO's ``a`` (``σ_t = a·sqrt(σ/(1-σ))``), not SA-Solver's
  ``τ``, and the same number injects a different amount of noise; AWM's grid tweaks (``t[0] = 1 - 1e-3``,
  ``t[-2] = t[-3]/2``) are not reproduced either: the model's own grid is used. ``noise_level = 0`` makes it the
  pure Euler ODE (AWM's PickScore preset, ``config/dgx_awm.py``@be51372, runs SA-Solver at ``noise_level = 0``).

Every solver's last step lands on ``σ = 0`` with the clean estimate ``x̂0 = x - σ·v`` (Euler to 0 and DPM-Solver++'s
lowered final order both give it exactly), which is the latent that is decoded. ``sde-band`` never samples the steps
of the model's clean tail (:meth:`Policy.clean_tail_steps`: the last one, or two on SD3's ``diffusers`` grid, where
the step into ``σ_min`` leaves noise the last step cannot remove): they stay Euler steps, as SA-Solver's final
``denoise_to_zero`` step runs at ``τ = 0``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal

import torch
from torch import Tensor

from rlpost.components.chain import DPM_SOLVER, ChainPlan, chain_counts, rollout_chains
from rlpost.core.api import CHAINS, CLEAN_SAMPLES, Policy, Range, Sampler, StepCounts
from rlpost.core.contract import PromptBatch, Rollout
from rlpost.ops.kernels import StepKernel, make_kernel

__all__ = ["Solver", "SolverSampler"]

Solver = Literal["euler", "dpm-solver++2", "sde-band"]
"""The rollout solvers of :class:`SolverSampler`."""

_ODE, _SDE = 0, 1  # kernel indices of the sde-band plan


class SolverSampler(Sampler):
    """Independent ODE chains (or ODE chains with a band of Flow-GRPO SDE steps) for likelihood-free update rules;
    no edge is trainable.

    Args:
        num_steps: Solver steps ``T`` on the model's time grid (one denoiser forward per chain and step, also for
            the multistep DPM-Solver++).
        solver: ``"euler"`` (deterministic Euler ODE; DGPO), ``"dpm-solver++2"`` (deterministic multistep
            DPM-Solver++ 2M; DiffusionNFT's ``dpm2``) or ``"sde-band"`` (Flow-GRPO's SDE on the steps landing
            inside ``sde_band``, Euler elsewhere; a first-order stand-in for AWM's SA-Solver).
        noise_level: ``a`` of Flow-GRPO's SDE on the band steps of ``sde-band`` (0: the pure ODE). Must be 0 for the
            deterministic solvers.
        sde_band: ``[lo, hi]`` noise levels, ``0 <= lo < hi <= 1``: a step of ``sde-band`` is stochastic when the
            level it lands on lies in it (AWM: ``[0.3, 0.9]``).
        shared_noise: One initial noise per prompt group, repeated for its ``K`` samples (else one per sample).
        chunk_size: Maximum rows per denoiser forward and VAE decode; 0: the whole batch at once.
    """

    name: ClassVar[str] = "solver"
    provides: ClassVar[frozenset[str]] = frozenset({CLEAN_SAMPLES, CHAINS})

    def __init__(
        self,
        num_steps: Annotated[int, Range(ge=1)] = 10,
        solver: Solver = "euler",
        noise_level: Annotated[float, Range(ge=0)] = 0.0,
        sde_band: tuple[float, float] = (0.3, 0.9),
        shared_noise: bool = False,
        chunk_size: Annotated[int, Range(ge=0)] = 0,
    ) -> None:
        self.num_steps = int(num_steps)
        self.solver: Solver = solver
        self.noise_level = float(noise_level)
        self.sde_band = (float(sde_band[0]), float(sde_band[1]))
        self.shared_noise = bool(shared_noise)
        self.chunk_size = int(chunk_size)

    def validate(self, recipe: Any) -> list[str]:
        """Check the band, that only ``sde-band`` gets a noise level, and that the band can reach a step before the
        model's clean tail (the ranges of ``num_steps``, ``noise_level`` and ``chunk_size`` are declared on the
        arguments)."""
        problems = []
        if self.solver not in ("euler", "dpm-solver++2", "sde-band"):
            problems.append(
                f"sampler.init_args.solver: must be 'euler', 'dpm-solver++2' or 'sde-band', got {self.solver!r}"
            )
        lo, hi = self.sde_band
        if not (math.isfinite(lo) and math.isfinite(hi) and 0.0 <= lo < hi <= 1.0):
            problems.append(f"sampler.init_args.sde_band: must be [lo, hi] with 0 <= lo < hi <= 1, got [{lo}, {hi}]")
        if self.noise_level > 0 and self.solver != "sde-band":
            # A deterministic solver draws no noise: accepting the value would let a recipe believe it samples.
            problems.append(
                f"sampler.init_args.noise_level: {self.noise_level} has no effect with solver {self.solver!r}, a "
                "deterministic ODE solver; set it to 0, or use solver 'sde-band' to inject noise"
            )
        model = getattr(recipe, "model", None)
        tail = model.clean_tail_steps() if isinstance(model, Policy) else None
        if self.solver == "sde-band" and self.noise_level > 0 and tail is not None and self.num_steps <= tail:
            problems.append(
                f"sampler.init_args.num_steps: {self.num_steps} step(s) are all in the clean tail of "
                f"model.init_args.time_grid {getattr(model, 'time_grid', None)!r} ({tail} final deterministic "
                "step(s), so the image holds no sampled noise): no step is left for the SDE band"
            )
        return problems

    def step_kinds(self, sigmas: Tensor, clean_tail: int) -> list[int]:
        """For ``sde-band``: ``1`` (Flow-GRPO's SDE) for each step whose target level ``sigmas[i + 1]`` lies in the
        band, except the last ``max(clean_tail, 1)`` steps and unless ``noise_level`` is 0; ``0`` (Euler) otherwise.
        """
        lo, hi = self.sde_band
        if self.noise_level <= 0:
            return [_ODE] * self.num_steps
        last = self.num_steps - max(clean_tail, 1)
        return [_SDE if i < last and lo <= float(sigmas[i + 1]) <= hi else _ODE for i in range(self.num_steps)]

    def plan(self, sigmas: Tensor, num_samples: int, generator: torch.Generator, clean_tail: int = 1) -> ChainPlan:
        """The solver's step kernels on ``sigmas`` (no edge trainable; draws nothing from ``generator``).

        Raises:
            ValueError: When the grid does not end at ``σ = 0`` (the last step must land on the clean latent), or for
                an unknown solver.
        """
        sigmas = sigmas.detach().float().cpu()
        if sigmas.shape != (self.num_steps + 1,) or float(sigmas[-1]) != 0.0:
            raise ValueError(
                f"solver sampler: the time grid must hold {self.num_steps + 1} levels ending at 0, got "
                f"{sigmas.tolist()}"
            )
        trainable = torch.zeros((num_samples, self.num_steps), dtype=torch.bool)
        if self.solver == "dpm-solver++2":
            return ChainPlan(sigmas, [DPM_SOLVER], [None], [0] * self.num_steps, trainable)
        if self.solver == "euler":
            return ChainPlan(sigmas, ["ode"], [make_kernel("ode")], [0] * self.num_steps, trainable)
        if self.solver != "sde-band":
            raise ValueError(f"solver sampler: unknown solver {self.solver!r}")
        kernels: list[StepKernel | None] = [make_kernel("ode"), make_kernel("flow-sde", noise_level=self.noise_level)]
        return ChainPlan(sigmas, ["ode", "flow-sde"], kernels, self.step_kinds(sigmas, clean_tail), trainable)

    def rollout(self, policy: Policy, batch: PromptBatch, generator: torch.Generator) -> Rollout:
        """Run ``G·K`` chains batched; the initial noise and then the band steps' noise come from ``generator``."""
        return self._rollout(policy, batch, generator)

    def rollout_groups(self, policy: Policy, batch: PromptBatch, generators: Sequence[torch.Generator]) -> Rollout:
        """Every group's chains in one batch, group ``j`` drawing from ``generators[j]`` what :meth:`rollout` of it
        alone draws (:func:`rlpost.rollout_chains` with one generator per group)."""
        return self._rollout(policy, batch, generators)

    def _rollout(
        self, policy: Policy, batch: PromptBatch, generator: torch.Generator | Sequence[torch.Generator]
    ) -> Rollout:
        tail = policy.clean_tail_steps() or 1  # unknown grid: at least the final step to 0 stays deterministic
        chunk = self.chunk_size or batch.num_groups * batch.samples_per_group
        plan = functools.partial(self.plan, clean_tail=tail)
        # No edge is trainable, so the log-prob reduction only labels the band edges' recorded densities.
        return rollout_chains(policy, batch, generator, self.num_steps, plan, self.shared_noise, chunk, "mean")

    def counts(self, num_groups: int, samples_per_group: int) -> StepCounts:
        """``S = G·K`` images and ``S·T`` rollout forwards (one per chain and step for every solver); no trainable
        edge and no training forward of the sampler's (the update rule counts its own, ``train_counts``)."""
        return chain_counts(num_groups, samples_per_group, self.num_steps, 0)
