"""MixGRPO's sampler (Li et al. 2025, ``Tencent-Hunyuan/MixGRPO`` ``fastvideo/utils/sampling_utils.py:
run_sample_step``@e5cdd6a; arXiv 2507.21802) on the rlpost chain core.

Each chain runs the ODE outside a sliding window and Flow-GRPO's SDE (``--flow_grpo_sampling``, noise level
``a = 0.7``, ``flow_grpo_step`` in the same file) inside it; only window steps are trained. The window moves across
iterations (:class:`~rlpost_mixgrpo.window.WindowScheduler`), advanced in :meth:`MixGRPOSampler.begin_step` once per
training step, so every rollout of a step (one per prompt group under ``distributed``) uses the same window.
MixGRPO-Flash replaces the ODE steps after the window by fewer steps of multistep DPM-Solver++ (order 2) on a fresh
time-shifted schedule (``dpm_step``, same file):
``R = T - end`` remaining steps become ``max(1, floor(R · compress_ratio))`` steps from ``σ_end`` to 0.

The last step always lies outside the window (windows end before ``T - 2``), so it is deterministic and lands on
``x̂0``, the image that is decoded.
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
    DPM_SOLVER,
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
    evaluate_edges,
    make_kernel,
    run_chains,
    shared_or_independent_noise,
    shifted_tail_sigmas,
)

from .window import WindowScheduler, WindowStrategy

__all__ = ["MixGRPOSampler", "compressed_tail"]

_SDE, _ODE, _DPM = 0, 1, 2


def compressed_tail(sigma_end: float, remaining: int, compress_ratio: float, shift: float) -> Tensor:
    """MixGRPO-Flash's post-window schedule: ``max(1, floor(remaining · ratio))`` steps from ``sigma_end`` to 0.

    The step count is Flash's (upstream ``run_sample_step`` compresses the ``remaining`` steps by ``compress_ratio``);
    the grid itself is :func:`rlpost.shifted_tail_sigmas` (the unshifted time of ``sigma_end`` spaced linearly to 0
    and shifted again, so the tail keeps the model's time-shift profile).

    Returns:
        ``[n + 1]`` fp32 noise levels, ``[0] == sigma_end`` and ``[-1] == 0``.
    """
    return shifted_tail_sigmas(sigma_end, max(1, math.floor(remaining * compress_ratio)), shift)


class MixGRPOSampler(Sampler):
    """ODE chains with a moving SDE window; only window steps are trained.

    Args:
        num_steps: Sampling steps ``T`` of the base schedule.
        noise_level: ``a`` of Flow-GRPO's SDE inside the window (MixGRPO ``eta`` 0.7).
        window_size: ``w``, SDE (trained) steps per sample (MixGRPO 4 of 25 steps).
        shift_interval: ``τ``, iterations between window moves (MixGRPO 25; Flash 20).
        window_strategy: ``"progressive"`` (default), ``"random"`` or ``"decay"`` (see ``window.py``).
        window_stride: Steps the progressive window moves by; ``null`` = ``w`` (non-overlapping), 0 = frozen window
            (MixGRPO-Flash*). MixGRPO's script uses 1 (overlapping).
        roll_back: Restart the progressive window at step 0 after the last window (MixGRPO ``--roll_back``).
        window_limit: Windows lie in ``[0, window_limit)``; ``null`` = ``num_steps - 2`` (upstream).
        decay_rate: ``k`` of the ``decay`` strategy.
        decay_offset: Window start after which ``decay`` shortens ``τ``.
        window_seed: Seed of the ``random`` strategy.
        shift_over: What moves the window: ``"iterations"`` (upstream: every ``shift_interval`` iterations, with
            ``roll_back``), or the run's progress ``p``, so that the progressive window sweeps its starts ``0,
            stride, 2·stride, ...`` once over the whole run, whatever its length or the machine's speed: ``"steps"``
            (``p = step / (run.max_steps - 1)``) or ``"time"`` (``p`` = training seconds spent / ``budget_s``, capped
            at 1; ``rlpost bench`` fills in its time budget). At progress ``p`` the window starts at the
            ``floor(p·n)``-th of the ``n`` starts (the last one once ``p = 1``). Progressive strategy only.
        budget_s: Training seconds of the run, with ``shift_over: time``.
        init_same_noise: Share the initial noise within a group (MixGRPO's script sets ``--init_same_noise``).
        dpm_after_window: MixGRPO-Flash: DPM-Solver++ (2M) with a compressed schedule after the window.
        compress_ratio: Flash's step compression after the window (0.4 Flash, 0.2 Flash*).
        shift: The model's static time shift, used to build Flash's compressed tail (SD3/SD3.5: 3.0).
        logprob_reduction: ``"mean"`` (anchor convention) or ``"sum"`` over latent elements.
        chunk_size: Maximum rows per denoiser forward during the rollout (memory budget).
    """

    name: ClassVar[str] = "mix"
    provides: ClassVar[frozenset[str]] = frozenset({CHAINS, CLEAN_SAMPLES, EDGE_LOG_PROBS})

    def __init__(
        self,
        num_steps: Annotated[int, Range(ge=3)] = 10,
        noise_level: Annotated[float, Range(gt=0)] = 0.7,
        window_size: int = 2,
        shift_interval: int = 25,
        window_strategy: WindowStrategy = "progressive",
        window_stride: int | None = 1,
        roll_back: bool = True,
        window_limit: int | None = None,
        decay_rate: float = 0.1,
        decay_offset: int = 13,
        window_seed: int = 0,
        shift_over: Literal["iterations", "steps", "time"] = "iterations",
        budget_s: float | None = None,
        init_same_noise: bool = True,
        dpm_after_window: bool = False,
        compress_ratio: Annotated[float, Range(gt=0, le=1)] = 0.4,
        shift: Annotated[float, Range(gt=0)] = 3.0,
        logprob_reduction: LogProbReduction = "mean",
        chunk_size: Annotated[int, Range(ge=1)] = 16,
    ) -> None:
        self.num_steps = int(num_steps)
        self.noise_level = float(noise_level)
        self.init_same_noise = bool(init_same_noise)
        self.dpm_after_window = bool(dpm_after_window)
        self.compress_ratio = float(compress_ratio)
        self.shift = float(shift)
        self.logprob_reduction: LogProbReduction = logprob_reduction
        self.chunk_size = int(chunk_size)
        self.scheduler = WindowScheduler(
            num_steps=self.num_steps,
            window_size=window_size,
            shift_interval=shift_interval,
            strategy=window_strategy,
            stride=window_stride,
            roll_back=roll_back,
            limit=window_limit,
            decay_rate=decay_rate,
            decay_offset=decay_offset,
            seed=window_seed,
        )
        self.shift_over = shift_over
        self.budget_s = None if budget_s is None else float(budget_s)
        self._progress = 0.0  # the run's progress at the coming step (shift_over: steps or time)
        self._spent_s = 0.0  # training seconds so far (shift_over: time), in state_dict
        self._kernels: list[StepKernel | None] = [
            make_kernel("flow-sde", noise_level=self.noise_level),
            make_kernel("ode"),
            None,  # DPM-Solver++ (2M): deterministic and multistep, run by the chain core
        ]

    def validate(self, recipe: Any) -> list[str]:
        """Check the window settings and that the window fits the schedule (the ranges of ``num_steps``, the noise
        level, Flash's compression, ``shift`` and ``chunk_size`` are declared on the arguments)."""
        problems = [f"sampler.init_args.{p}" for p in self.scheduler.problems()]
        if self.shift_over not in ("iterations", "steps", "time"):
            problems.append(f"sampler.init_args.shift_over: 'iterations', 'steps' or 'time', got {self.shift_over!r}")
        elif self.shift_over != "iterations":
            where = f"sampler.init_args.shift_over: {self.shift_over}"
            if self.scheduler.strategy != "progressive" or self.scheduler.stride < 1:
                problems.append(
                    f"{where} sweeps a progressive window (window_strategy progressive, window_stride >= 1)"
                )
            if self.shift_over == "time" and not (self.budget_s is not None and self.budget_s > 0):
                problems.append(
                    f"sampler.init_args.budget_s: shift_over: time needs the run's training-time budget in seconds "
                    f"(rlpost bench fills in its own), got {self.budget_s}"
                )
        if self.shift_over != "time" and self.budget_s is not None:
            problems.append("sampler.init_args.budget_s: only used with shift_over: time")
        return problems

    # ---------------------------------------------------------------------------------------------- planning
    def schedule(self, sigmas: Tensor, window: tuple[int, int]) -> tuple[Tensor, list[int]]:
        """Noise levels and kernel per step for a window: ODE, SDE in ``[start, end)``, then ODE or DPM-Solver++."""
        start, end = window
        sigmas = sigmas.detach().float().cpu()
        kinds = [_ODE] * start + [_SDE] * (end - start)
        if self.dpm_after_window:
            tail = compressed_tail(float(sigmas[end]), self.num_steps - end, self.compress_ratio, self.shift)
            return torch.cat([sigmas[: end + 1], tail[1:]]), kinds + [_DPM] * (tail.shape[0] - 1)
        return sigmas, kinds + [_ODE] * (self.num_steps - end)

    def steps_for(self, window: tuple[int, int]) -> int:
        """Denoiser steps per chain for ``window`` (``T``, or fewer with Flash's compressed tail)."""
        if not self.dpm_after_window:
            return self.num_steps
        end = window[1]
        return end + max(1, math.floor((self.num_steps - end) * self.compress_ratio))

    # --------------------------------------------------------------------------------------------- sampling
    def begin_run_step(self, step: int, max_steps: int) -> None:
        """With ``shift_over: steps``: the run's progress at ``step`` (time progress is summed in
        :meth:`end_run_step`)."""
        if self.shift_over == "steps":
            self._progress = step / (max_steps - 1) if max_steps > 1 else 0.0

    def end_run_step(self, seconds: float) -> None:
        """With ``shift_over: time``: add the step's training seconds to the run's progress."""
        if self.shift_over == "time" and self.budget_s:
            self._spent_s += float(seconds)
            self._progress = min(1.0, self._spent_s / self.budget_s)

    def begin_step(self, step: int, generator: torch.Generator) -> None:
        """Bring the window scheduler to ``step`` (one iteration per training step; no random draw); over the run
        (``shift_over`` steps or time), place the window by the run's progress instead."""
        if self.shift_over == "iterations":
            self.scheduler.advance_to(step)
            return
        starts = range(0, self.scheduler.limit - self.scheduler.window_size + 1, self.scheduler.stride)
        self.scheduler.start = starts[min(len(starts) - 1, math.floor(self._progress * len(starts)))]
        self.scheduler.iteration = step

    def rollout(self, policy: Policy, batch: PromptBatch, generator: torch.Generator) -> Rollout:
        """Sample every chain with the step's window (the scheduler is not advanced here: see :meth:`begin_step`)."""
        return self._run(policy, batch, generator)

    def rollout_groups(self, policy: Policy, batch: PromptBatch, generators: Sequence[torch.Generator]) -> Rollout:
        """Every group's chains in one batch, group ``j`` drawing from ``generators[j]`` what :meth:`rollout` of it
        alone draws (its initial noise, then its rows of each window step's noise; the plan draws nothing)."""
        return self._run(policy, batch, generators)

    def _run(
        self, policy: Policy, batch: PromptBatch, generator: torch.Generator | Sequence[torch.Generator]
    ) -> Rollout:
        noise = shared_or_independent_noise(
            policy, batch.num_groups, batch.samples_per_group, generator, self.init_same_noise
        )
        s = batch.num_groups * batch.samples_per_group
        window = self.scheduler.window()
        sigmas, kinds = self.schedule(policy.sigmas(self.num_steps), window)
        trainable = torch.zeros((s, len(kinds)), dtype=torch.bool)
        trainable[:, window[0] : window[1]] = True
        plan = ChainPlan(sigmas, ["flow-sde", "ode", DPM_SOLVER], self._kernels, kinds, trainable)
        rollout = run_chains(policy, batch, generator, plan, noise, self.chunk_size, self.logprob_reduction)
        rollout.stats["sampler/window_start"] = float(window[0])
        return rollout

    def evaluate(self, policy: Policy, rollout: Rollout, edges: Tensor) -> EdgeEval:
        """Recompute the log-probs of window ``edges`` with Flow-GRPO's SDE (one forward per parent)."""
        return evaluate_edges(policy, rollout, edges, self._kernels, self.logprob_reduction)

    def counts(self, num_groups: int, samples_per_group: int) -> StepCounts:
        """For the scheduler's current window (the running step's, or the last step's between steps): ``S·w``
        trained edges and ``S·steps_for(window)`` rollout forwards."""
        s = num_groups * samples_per_group
        window = self.scheduler.window()
        edges = s * (window[1] - window[0])
        return StepCounts(
            images=s, trainable_edges=edges, rollout_forwards=s * self.steps_for(window), train_forwards=edges
        )

    def state_dict(self) -> dict[str, Any]:
        """The window scheduler's position: the last begun step's window (``begin_step`` of the next step advances it,
        so a resume continues the window sequence)."""
        state: dict[str, Any] = {"window": self.scheduler.state_dict()}
        if self.shift_over != "iterations":  # the run's progress (training seconds over time)
            state |= {"progress": self._progress, "spent_s": self._spent_s}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the window scheduler and the run's progress."""
        if "window" in state:
            self.scheduler.load_state_dict(state["window"])
        self._progress = float(state.get("progress", 0.0))
        self._spent_s = float(state.get("spent_s", 0.0))
