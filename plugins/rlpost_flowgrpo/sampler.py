"""Flow-GRPO's sampler (Liu et al. 2025, arXiv 2505.05470) and Flow-GRPO-Fast's SDE window, on the rlpost chain core.

Restated from ``yifan123/flow_grpo`` at 9745241 (cited below as ``@9745241``):

* **Flow-GRPO** (``scripts/train_sd3.py``@9745241 L608-687, ``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py``
  @9745241 L42-89): every step of the model's grid is an SDE step (``sde``: Flow-SDE with noise level ``a``;
  ``cps``: coefficients-preserving sampling, whose log-prob drops constants and the ``1/(2s²)`` factor); each chain
  trains its first ``int(T · timestep_fraction)`` steps, in order (``num_train_timesteps``, L345-351 and L893: 9 of
  10 at ``timestep_fraction = 0.99``, i.e. every step but the last).
* **Flow-GRPO-Fast** (``flow_grpo/diffusers_patch/sd3_pipeline_with_logprob_fast.py``@9745241 L135-195): with
  ``sde_window_size = w > 0`` a window start is drawn uniformly from ``[lo, hi - w]`` (``sde_window_range``) once per
  pipeline call, i.e. per rollout batch per rank; steps before and after the window are deterministic (noise level
  0, which is the Euler ODE step for both kernels) and exactly the ``w`` window edges are trained
  (``scripts/train_sd3_fast.py``@9745241 L347-351). Here the draw is made once per :meth:`FlowGRPOSampler.rollout`
  call (one process: once per step for the whole batch) and once per prompt group under ``distributed``
  (:meth:`FlowGRPOSampler.rollout_groups`, each group from its own generator, so a group's rollout does not depend on
  which rank holds it). The README describes Fast as one shared ODE prefix per prompt that branches at a random step;
  the code at 9745241 has no shared prefix (every image its own initial noise and trajectory), and neither has this
  sampler (``docs/algorithms/flowgrpo.md``).
* ``same_latent`` shares the initial noise of a group (upstream seeds one generator per prompt from SHA-256 of the
  prompt, ``scripts/train_sd3.py``@9745241 L169-178, used only for the initial latents); step noise stays independent.
* ``record_old_means`` also stores every edge's behaviour step mean ``μ_old`` (capability ``edge-old-means``), what
  GRPO-Guard's ratio normalisation needs (``scripts/train_sd3_GRPO_Guard.py``@9745241 L645-707).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal

import torch
from torch import Tensor

from rlpost import (
    CHAINS,
    CLEAN_SAMPLES,
    EDGE_LOG_PROBS,
    EDGE_OLD_MEANS,
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
    make_kernel,
    rollout_chains,
)

__all__ = ["FlowGRPOSampler", "KernelName"]

KernelName = Literal["sde", "cps"]
_KERNEL_NAMES = {"sde": "flow-sde", "cps": "cps"}
_SDE, _ODE = 0, 1


class FlowGRPOSampler(Sampler):
    """Independent SDE chains with Flow-GRPO's step (or CPS), all steps or a Fast window of SDE steps.

    Args:
        num_steps: Denoising steps ``T`` (SD3.5 presets: 10).
        kernel: ``"sde"`` (Flow-SDE, Flow-GRPO's default) or ``"cps"`` (coefficients-preserving sampling with
            Flow-GRPO's constant-free log-prob ``-mean((x'-μ)²)``; the Fast presets).
        noise_level: ``a``: 0.7 for ``sde`` (every SD3.5 preset), 0.8 for ``cps`` (the Fast presets); ``cps`` needs
            ``a <= 1``.
        timestep_fraction: Without a window, each chain trains its first ``int(T · fraction)`` steps in order
            (upstream 0.99: 9 of 10). Ignored when ``sde_window_size > 0`` (the window is what is trained).
        same_latent: All chains of a group start from the same initial noise (upstream ``sample.same_latent``).
        sde_window_size: Flow-GRPO-Fast's window ``w``: SDE (and trained) steps per chain, ODE elsewhere. 0: no
            window, every step is an SDE step (Flow-GRPO).
        sde_window_range: ``(lo, hi)``: the window start is uniform in ``[lo, hi - w]``; ``null`` = ``(0, T)``.
            The Fast presets use ``(0, 5)``.
        record_old_means: Record each edge's behaviour step mean (provides ``edge-old-means``, which
            ``ratio_norm`` of the ``flow-grpo`` update rule, GRPO-Guard, requires). Costs one latent per edge.
        logprob_reduction: ``"mean"`` over latent elements (upstream) or ``"sum"``.
        chunk_size: Maximum rows per denoiser forward during the rollout (memory budget).
    """

    name: ClassVar[str] = "flow-grpo"
    provides: ClassVar[frozenset[str]] = frozenset({CHAINS, CLEAN_SAMPLES, EDGE_LOG_PROBS})

    def __init__(
        self,
        num_steps: Annotated[int, Range(ge=2)] = 10,
        kernel: KernelName = "sde",
        noise_level: Annotated[float, Range(gt=0)] = 0.7,
        timestep_fraction: Annotated[float, Range(gt=0, le=1)] = 0.99,
        same_latent: bool = False,
        sde_window_size: Annotated[int, Range(ge=0)] = 0,
        sde_window_range: tuple[int, int] | None = None,
        record_old_means: bool = False,
        logprob_reduction: LogProbReduction = "mean",
        chunk_size: Annotated[int, Range(ge=1)] = 16,
    ) -> None:
        self.num_steps = int(num_steps)
        self.kernel = kernel
        self.noise_level = float(noise_level)
        self.timestep_fraction = float(timestep_fraction)
        self.same_latent = bool(same_latent)
        self.sde_window_size = int(sde_window_size)
        rng = (0, self.num_steps) if sde_window_range is None else sde_window_range
        self.sde_window_range = (int(rng[0]), int(rng[1]))
        self.record_old_means = bool(record_old_means)
        self.logprob_reduction: LogProbReduction = logprob_reduction
        self.chunk_size = int(chunk_size)
        if self.record_old_means:
            # Declared per instance: only a sampler asked to record the means provides them.
            self.provides = type(self).provides | {EDGE_OLD_MEANS}  # type: ignore[misc]
        self._kernels: list[StepKernel | None] = [self._make_sde_kernel(), make_kernel("ode")]

    def _make_sde_kernel(self) -> StepKernel | None:
        if self.kernel == "sde":
            return make_kernel("flow-sde", noise_level=self.noise_level)
        if self.kernel == "cps" and self.noise_level <= 1.0:
            return make_kernel("cps", noise_level=self.noise_level, log_prob="flow-grpo")
        return None  # reported by validate()

    @property
    def kernel_names(self) -> list[str]:
        """Kernel names recorded in ``Rollout.kernels``: the SDE kernel's (``flow-sde`` or ``cps``), then ``ode``."""
        return [_KERNEL_NAMES.get(self.kernel, str(self.kernel)), "ode"]

    @property
    def train_steps(self) -> int:
        """Edges trained per chain: ``w`` with a window, else ``int(T · timestep_fraction)`` (upstream's truncation)."""
        if self.sde_window_size > 0:
            return self.sde_window_size
        return int(self.num_steps * self.timestep_fraction)

    def validate(self, recipe: Any) -> list[str]:
        """Check the kernel, that some step is trained and that every window fits the schedule (the ranges of the
        scalar arguments are declared on them)."""
        field = "sampler.init_args."
        problems = []
        if self.kernel not in _KERNEL_NAMES:
            problems.append(f"{field}kernel: must be 'sde' or 'cps', got {self.kernel!r}")
        elif self.kernel == "cps" and self.noise_level > 1.0:
            problems.append(f"{field}noise_level: cps needs a noise level in (0, 1], got {self.noise_level}")
        if self.train_steps < 1:
            problems.append(
                f"{field}timestep_fraction: int({self.num_steps} steps x {self.timestep_fraction}) = 0 steps would "
                "be trained; raise it or num_steps"
            )
        w, (lo, hi) = self.sde_window_size, self.sde_window_range
        if w > 0 and (not 0 <= lo <= hi - w or hi > self.num_steps):
            problems.append(
                f"{field}sde_window_range: ({lo}, {hi}) must satisfy 0 <= lo <= hi - sde_window_size "
                f"({w}) and hi <= num_steps ({self.num_steps})"
            )
        return problems

    # ---------------------------------------------------------------------------------------------- planning
    def window_starts(self) -> list[int]:
        """The window starts a rollout may draw (uniform): ``lo … hi - w``; ``[0]`` without a window."""
        if self.sde_window_size == 0:
            return [0]
        lo, hi = self.sde_window_range
        return list(range(lo, hi - self.sde_window_size + 1))

    def draw_window(self, generator: torch.Generator) -> int:
        """A window start, uniform over :meth:`window_starts` (upstream's ``random.randint(lo, hi - w)``); draws
        nothing without a window."""
        starts = self.window_starts()
        if len(starts) == 1:
            return starts[0]
        return starts[int(torch.randint(len(starts), (1,), generator=generator))]

    def plan_for(self, sigmas: Tensor, num_samples: int, start: int) -> ChainPlan:
        """The chains' plan: SDE on every step and the first ``train_steps`` trained, or with a window starting at
        ``start``, ODE outside ``[start, start + w)`` and exactly the window trained."""
        t = self.num_steps
        trainable = torch.zeros((num_samples, t), dtype=torch.bool)
        if self.sde_window_size == 0:
            kinds = [_SDE] * t
            trainable[:, : self.train_steps] = True
        else:
            end = start + self.sde_window_size
            kinds = [_SDE if start <= i < end else _ODE for i in range(t)]
            trainable[:, start:end] = True
        return ChainPlan(sigmas.detach().float().cpu(), self.kernel_names, self._kernels, kinds, trainable)

    def plan(self, sigmas: Tensor, num_samples: int, generator: torch.Generator) -> ChainPlan:
        """:meth:`plan_for` a window drawn from ``generator`` (:meth:`draw_window`)."""
        return self.plan_for(sigmas, num_samples, self.draw_window(generator))

    # --------------------------------------------------------------------------------------------- sampling
    def rollout(self, policy: Policy, batch: PromptBatch, generator: torch.Generator) -> Rollout:
        """Sample ``samples_per_group`` chains per group, all chains batched; with a window, one draw for the call.

        Draw order from ``generator``: initial noise, the window start, then each SDE step's noise.
        """
        rollout = rollout_chains(
            policy,
            batch,
            generator,
            self.num_steps,
            self.plan,
            self.same_latent,
            self.chunk_size,
            self.logprob_reduction,
            self.record_old_means,
        )
        if self.sde_window_size > 0:
            steps = rollout.edge_step[rollout.trainable]
            rollout.stats["sampler/window_start"] = float(steps.min()) if steps.numel() else math.nan
        return rollout

    def rollout_groups(self, policy: Policy, batch: PromptBatch, generators: Sequence[torch.Generator]) -> Rollout:
        """Every group from its own generator, as :meth:`rollout` of it alone. Without a window all groups run in one
        batch (:func:`rlpost.rollout_chains`); with one, each group draws its own window, so groups are sampled one
        by one (the same rows, more transformer calls)."""
        if self.sde_window_size > 0:
            return super().rollout_groups(policy, batch, generators)
        return rollout_chains(
            policy,
            batch,
            generators,
            self.num_steps,
            self.plan,
            self.same_latent,
            self.chunk_size,
            self.logprob_reduction,
            self.record_old_means,
        )

    def evaluate(self, policy: Policy, rollout: Rollout, edges: Tensor) -> EdgeEval:
        """Recompute the log-probs of ``edges`` with the rollout's own kernel (one forward per parent)."""
        return evaluate_edges(policy, rollout, edges, self._kernels, self.logprob_reduction)

    def counts(self, num_groups: int, samples_per_group: int) -> StepCounts:
        """``S = G·K`` images, ``S·T`` rollout forwards and ``S·train_steps`` trained edges (= training forwards),
        whatever the window draw: the window moves, its size does not."""
        return chain_counts(num_groups, samples_per_group, self.num_steps, self.train_steps)
