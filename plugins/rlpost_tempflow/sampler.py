"""TempFlow-GRPO's comb sampler: an ODE trunk with ``k`` SDE children at every branch step, each child completed to
the image by ODE steps (He et al., arXiv 2508.04324, Sec. 3.1 "trajectory branching").

Restated from ``Shredded-Pork/TempFlow-GRPO`` ``flow_grpo/diffusers_patch/sd3_pipeline_with_logprob_perstep.py``
@e66824e (``pipeline_with_logprob``) and ``sd3_sde_with_logprob_perstep.py``@e66824e (``sde_step_with_logprob``).
Per trunk (one initial noise) with schedule ``σ_0 = 1 > … > σ_T = 0`` and branch steps ``B`` (upstream: every step
of ``timesteps[:-1]``, i.e. ``0 … T-2``):

* the trunk node ``x_i`` is evaluated once per step ``i ≤ max B``; its velocity serves both the trunk's Euler step
  to ``x_{i+1}`` and, when ``i ∈ B``, ``k`` children drawn around the same step Gaussian ``N(μ_i, S_i²I)`` of
  Flow-GRPO's SDE (upstream hard-codes ``num_samples = 6``); the child edges record ``log π_old`` and are trainable;
* each child is completed by Euler ODE steps over the remaining grid (upstream's inner loop over
  ``timesteps[i+1:]``) or, as an rlpost option, a shortened tail (:mod:`rlpost.ops.trees.tails`), then decoded and
  scored: one reward per (trunk, branch step, child).

Unlike upstream, which completes each step's children in their own inner loop, every iteration here evaluates the
whole frontier (trunk nodes and all completing children of every group) in one batched velocity call; the rows are
the same. Trunk, tail and ODE edges are recorded with the ``"ode"`` kernel (or the DPM tail), ``trainable=False``,
NaN log-prob; each such node has one child, so a child's reward passes back to its branch edge unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import torch
from torch import Tensor

from rlpost import (
    CLEAN_SAMPLES,
    DPM_TAIL_KERNEL,
    EDGE_LOG_PROBS,
    TREE,
    EdgeEval,
    LogProbReduction,
    NoiseSource,
    PerGroupNoise,
    Policy,
    PromptBatch,
    Range,
    Rollout,
    RolloutBuilder,
    Sampler,
    SharedNoise,
    StepCounts,
    StepKernel,
    TailGrid,
    TailSolver,
    TailStepper,
    branch_children,
    evaluate_edges,
    frontier_velocity,
    make_kernel,
    tail_nfe,
    tail_problems,
    tail_sigmas,
)

__all__ = ["TempFlowSampler"]

SDEKernelName = Literal["flow-sde", "dance-sde", "cps"]


@dataclass
class _Cohort:
    """The children born at one branch step, completing together along their own levels (indices into the table)."""

    x: Tensor
    ids: Tensor
    groups: Tensor
    levels: list[int]
    stepper: TailStepper
    pos: int = 0

    @property
    def done(self) -> bool:
        return self.pos >= len(self.levels) - 1


class TempFlowSampler(Sampler):
    """TempFlow-GRPO's comb: ODE trunk, ``k`` SDE children per branch step, ODE completion of every child.

    Args:
        num_steps: Schedule length ``T`` (upstream's ``sample.num_steps``: 10).
        k: Children per branch step (upstream hard-codes 6).
        branch_steps: Steps that branch (``0 … T-1``); ``null`` = every step but the last (upstream's
            ``timesteps[:-1]``).
        kernel: SDE kernel of the branch steps; Flow-GRPO's (``"flow-sde"``) is upstream's.
        kernel_args: Constructor arguments of ``kernel`` (upstream: ``{noise_level: 0.7}`` for SD3.5-M, 0.9 for FLUX
            per its code comment); ``null`` uses the kernel's defaults.
        logprob_reduction: ``"mean"`` (upstream) or ``"sum"`` over latent elements.
        trunks_per_prompt: Trunks (independent initial noises) per prompt group (upstream: ``num_image_per_prompt``
            4); the children of all trunks of a prompt at one step form one normalisation group.
        chunk_size: Maximum rows per transformer forward and per VAE decode (memory only).
        ode_kernel: Kernel of the trunk and completion steps (only ``"ode"``, the Euler step).
        tail: How children are completed (beyond upstream: :mod:`rlpost.ops.trees.tails`): ``"full"`` (upstream)
            one Euler step per remaining step of the run's grid; ``"euler"`` or ``"dpm-solver++"`` on a shortened grid.
        tail_steps: Transformer evaluations per child after its branch step, ``min(tail_steps, T-i-1)``
            (``null``: every remaining step). Only with ``tail`` ``"euler"`` or ``"dpm-solver++"``.
        tail_grid: ``"run"`` (evenly spread points of the run's remaining grid) or ``"compressed"`` (a fresh
            time-shifted grid, shift ``tail_shift``).
        tail_shift: Time shift of the ``compressed`` tail grid.
    """

    name: ClassVar[str] = "tempflow"
    provides: ClassVar[frozenset[str]] = frozenset({TREE, CLEAN_SAMPLES, EDGE_LOG_PROBS})

    def __init__(
        self,
        num_steps: Annotated[int, Range(ge=2)] = 10,
        k: Annotated[int, Range(ge=2)] = 6,
        branch_steps: list[int] | None = None,
        kernel: SDEKernelName = "flow-sde",
        kernel_args: dict[str, Any] | None = None,
        logprob_reduction: LogProbReduction = "mean",
        trunks_per_prompt: Annotated[int, Range(ge=1)] = 1,
        chunk_size: Annotated[int, Range(ge=1)] = 64,
        ode_kernel: Literal["ode"] = "ode",
        tail: TailSolver = "full",
        tail_steps: Annotated[int, Range(ge=1)] | None = None,
        tail_grid: TailGrid = "run",
        tail_shift: Annotated[float, Range(gt=0)] = 3.0,
    ) -> None:
        self.num_steps = int(num_steps)
        self.k = int(k)
        self.branch_steps = None if branch_steps is None else [int(s) for s in branch_steps]
        self.kernel = kernel
        self.kernel_args: dict[str, Any] = dict(kernel_args or {})
        self.logprob_reduction: LogProbReduction = logprob_reduction
        self.trunks_per_prompt = int(trunks_per_prompt)
        self.chunk_size = int(chunk_size)
        self.ode_kernel = ode_kernel
        self.tail: TailSolver = tail
        self.tail_steps = None if tail_steps is None else int(tail_steps)
        self.tail_grid: TailGrid = tail_grid
        self.tail_shift = float(tail_shift)
        self._kernels: list[StepKernel | None] | None = None

    # ------------------------------------------------------------------------------------------ configuration

    @property
    def steps(self) -> list[int]:
        """The branch steps in increasing order (default ``0 … T-2``)."""
        if self.branch_steps is None:
            return list(range(self.num_steps - 1))
        return sorted(set(self.branch_steps))

    @property
    def kernel_names(self) -> list[str]:
        """Names aligned with ``Rollout.kernels``: 0 the branch SDE kernel, 1 the ODE kernel, 2 the DPM tail."""
        names: list[str] = [self.kernel, self.ode_kernel]
        return names + [DPM_TAIL_KERNEL] if self.tail == "dpm-solver++" else names

    @property
    def kernels(self) -> list[StepKernel | None]:
        """Kernel objects aligned with :attr:`kernel_names` (``None`` for the DPM tail, never evaluated)."""
        if self._kernels is None:
            built: list[StepKernel | None] = [
                make_kernel(self.kernel, **self.kernel_args),
                make_kernel(self.ode_kernel),
            ]
            self._kernels = built + [None] if self.tail == "dpm-solver++" else built
        return self._kernels

    def tail_nfe(self, step: int) -> int:
        """Transformer evaluations per child branched at ``step``: ``min(tail_steps, T-step-1)``."""
        return tail_nfe(self.num_steps - step - 1, self.tail_steps)

    def validate(self, recipe: Any) -> list[str]:
        """Check the branch steps fit the schedule, the tail settings agree and the kernel is stochastic."""
        p = "sampler.init_args"
        problems: list[str] = []
        if self.branch_steps is not None:
            bad = [s for s in self.branch_steps if not 0 <= s <= self.num_steps - 1]
            if not self.branch_steps or bad:
                problems.append(
                    f"{p}.branch_steps: need at least one step, each in [0, num_steps - 1] = [0, {self.num_steps - 1}]"
                    f", got {self.branch_steps}"
                )
            elif len(set(self.branch_steps)) != len(self.branch_steps):
                problems.append(f"{p}.branch_steps: steps must be distinct, got {self.branch_steps}")
        problems += tail_problems(p, self.tail, self.tail_steps, self.tail_grid)
        try:
            kernels = self.kernels
        except (TypeError, ValueError) as exc:
            problems.append(f"{p}.kernel_args: cannot build kernel {self.kernel!r}: {exc}")
        else:
            if kernels[0] is None or not kernels[0].stochastic:
                problems.append(f"{p}.kernel: the branch kernel must be stochastic, got {self.kernel!r}")
        return problems

    # ------------------------------------------------------------------------------------------------ counts

    def counts(self, num_groups: int, samples_per_group: int) -> StepCounts:
        """Closed-form per-step counts; ``samples_per_group`` is ignored (images per prompt = ``trunks·k·|B|``).

        Per trunk: ``max B + 1`` trunk rows (the trunk stops after its last branch step) plus ``k·Σ_{i∈B} n_i``
        completion rows with ``n_i = min(tail_steps, T-i-1)``; upstream's T=10, k=6 gives ``9 + 6·45 = 279``.
        One training forward per (trunk, branch step): its ``k`` children share the parent's evaluation.
        """
        trunks = num_groups * self.trunks_per_prompt
        steps = self.steps or [0]
        per_trunk = steps[-1] + 1 + self.k * sum(self.tail_nfe(i) for i in steps)
        return StepCounts(
            images=trunks * self.k * len(self.steps),
            trainable_edges=trunks * self.k * len(self.steps),
            rollout_forwards=trunks * per_trunk,
            train_forwards=trunks * len(self.steps),
        )

    # ----------------------------------------------------------------------------------------------- rollout

    def rollout(self, policy: Policy, batch: PromptBatch, generator: torch.Generator) -> Rollout:
        """Grow one comb per (prompt, trunk), decode and score every child.

        RNG order on ``generator``: the initial noises ``[G·trunks, ...]``, then one ``[G·trunks·k, ...]`` block of
        standard normals per branch step (trunks of a group adjacent, children of a trunk adjacent). Completion
        draws nothing. Samples are ordered by group, then branch step, trunk and child.
        """
        return self._grow(policy, batch, SharedNoise(generator, batch.num_groups))

    def rollout_groups(self, policy: Policy, batch: PromptBatch, generators: Sequence[torch.Generator]) -> Rollout:
        """All groups in one forward per iteration, group ``j`` drawing from ``generators[j]`` what a one-group
        :meth:`rollout` with it draws (same samples up to floating-point batch effects).

        Raises:
            ValueError: When the number of generators differs from the number of groups.
        """
        if len(generators) != batch.num_groups:
            raise ValueError(f"rollout_groups: {batch.num_groups} groups but {len(generators)} generators")
        return self._grow(policy, batch, PerGroupNoise(list(generators)))

    def _levels(self, sigmas: Tensor) -> tuple[Tensor, dict[int, list[int]]]:
        """The rollout's level table and, per branch step ``i``, the table indices its children visit.

        The run's grid comes first (trunk and branch edges keep their schedule indices, as :func:`evaluate_edges`
        needs); a shortened tail appends its levels after it, one segment per branch step.
        """
        table = [sigmas]
        size = self.num_steps + 1
        levels: dict[int, list[int]] = {}
        for i in self.steps:
            n = self.tail_nfe(i)
            own = sigmas if n == 0 else tail_sigmas(sigmas, self.num_steps, i + 1, n, self.tail_grid, self.tail_shift)
            if own is sigmas:
                levels[i] = list(range(i + 1, self.num_steps + 1))
                continue
            extra = own[i + 2 :]
            levels[i] = [i + 1] + list(range(size, size + extra.shape[0]))
            table.append(extra)
            size += int(extra.shape[0])
        return torch.cat(table), levels

    def _grow(self, policy: Policy, batch: PromptBatch, noise: NoiseSource) -> Rollout:
        k, steps = self.k, self.steps
        sde, ode = self.kernels[0], self.kernels[1]
        assert sde is not None and ode is not None  # built by make_kernel; only the DPM tail entry is None
        table, levels = self._levels(policy.sigmas(self.num_steps).detach().float().cpu())
        device = policy.device
        builder = RolloutBuilder(batch, table, self.kernel_names)
        cond = policy.encode(batch.prompts)
        groups = torch.arange(batch.num_groups).repeat_interleave(self.trunks_per_prompt)
        x = noise.initial(policy, self.trunks_per_prompt).to(device, torch.float32)
        ids = builder.add_nodes(x, 0, groups)
        cohorts: list[_Cohort] = []
        forwards = calls = 0
        t = 0
        while t <= steps[-1] or any(not c.done for c in cohorts):
            trunk_on = t <= steps[-1]
            active = [c for c in cohorts if not c.done]
            xs = ([x] if trunk_on else []) + [c.x for c in active]
            sig = ([table[t].expand(x.shape[0])] if trunk_on else []) + [
                table[c.levels[c.pos]].expand(c.x.shape[0]) for c in active
            ]
            rows = ([groups] if trunk_on else []) + [c.groups for c in active]
            frontier = torch.cat(xs)
            # One velocity call for the whole frontier: trunk nodes and every completing child of every group.
            v_all = frontier_velocity(
                policy, frontier, torch.cat(sig).to(device), cond, torch.cat(rows), self.chunk_size
            )
            forwards += frontier.shape[0]
            calls += -(-frontier.shape[0] // self.chunk_size)
            parts = list(torch.split(v_all, [int(a.shape[0]) for a in xs]))
            for c, v in zip(active, parts[1:] if trunk_on else parts, strict=True):
                s, s_next = table[c.levels[c.pos]], table[c.levels[c.pos + 1]]
                nxt, lp, kernel_index = c.stepper.step(
                    c.x, v, s.to(device).expand(c.x.shape[0]), s_next.to(device).expand(c.x.shape[0])
                )
                new = builder.add_nodes(nxt, c.levels[c.pos + 1], c.groups)
                builder.add_edges(c.ids, new, lp, False, kernel_index)
                c.x, c.ids, c.pos = nxt, new, c.pos + 1
            if trunk_on:
                v = parts[0]
                sigma = table[t].to(device).expand(x.shape[0])
                sigma_next = table[t + 1].to(device).expand(x.shape[0])
                if t in levels:
                    # k children around the trunk node's one step Gaussian (arXiv 2508.04324, Sec. 3.1).
                    z = noise.normal(x.shape[0] * k // batch.num_groups, x.shape[1:]).to(device)
                    out = branch_children(sde, x, v, sigma, sigma_next, k, z, self.logprob_reduction)
                    child_groups = groups.repeat_interleave(k)
                    child_ids = builder.add_nodes(out.next_latents, t + 1, child_groups)
                    builder.add_edges(ids.repeat_interleave(k), child_ids, out.log_prob, True, 0)
                    stepper = TailStepper(self.tail, ode, self.logprob_reduction)
                    cohorts.append(_Cohort(out.next_latents, child_ids, child_groups, levels[t], stepper))
                if t < steps[-1]:  # the trunk's Euler step (upstream's ``determistic=True`` branch)
                    step = ode.step(x, v, sigma, sigma_next, None, self.logprob_reduction)
                    x = step.next_latents
                    new_ids = builder.add_nodes(x, t + 1, groups)
                    builder.add_edges(ids, new_ids, step.log_prob, False, 1)
                    ids = new_ids
            t += 1
        # Group-major sample order (a group's samples one block: branch step, trunk, child), as one rollout per group.
        order = torch.argsort(torch.cat([c.groups for c in cohorts]), stable=True)
        final, final_ids = (
            torch.cat([c.x for c in cohorts])[order.to(device)],
            torch.cat([c.ids for c in cohorts])[order],
        )
        media = torch.cat(
            [policy.decode(final[c : c + self.chunk_size]) for c in range(0, final.shape[0], self.chunk_size)]
        )
        stats = {
            "tempflow/branch_steps": float(len(steps)),
            "tempflow/images": float(final.shape[0]),
            "perf/rollout_forwards": float(forwards),
            "perf/rollout_calls": float(calls),
        }
        return builder.build(final_ids, media, stats)

    def evaluate(self, policy: Policy, rollout: Rollout, edges: Tensor) -> EdgeEval:
        """Recompute the branch edges' log-probs with one forward per trunk node (the shared :func:`evaluate_edges`).

        Branch edges keep the run grid's indices (a shortened tail only appends levels), so ``rollout.sigmas[step]``
        and ``[step + 1]`` are the branch step's levels."""
        if rollout.kernels != self.kernel_names:
            raise ValueError(f"rollout kernels {rollout.kernels} do not match this sampler's {self.kernel_names}")
        return evaluate_edges(policy, rollout, edges, self.kernels, self.logprob_reduction)

    def __repr__(self) -> str:
        tail = "" if self.tail == "full" else f", tail={self.tail!r}, tail_steps={self.tail_steps}"
        return (
            f"TempFlowSampler(T={self.num_steps}, k={self.k}, branch_steps={self.steps}, kernel={self.kernel!r}"
            f"{self.kernel_args or ''}, reduction={self.logprob_reduction!r}, trunks={self.trunks_per_prompt}{tail})"
        )
