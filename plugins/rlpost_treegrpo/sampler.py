"""TreeGRPO's tree sampler: an ODE trunk, one ``k``-ary SDE window of depth ``d``, ODE tails (Ding & Ye,
arXiv 2512.08153, Sec. "Method").

Per prompt group and tree, with schedule ``σ_0 = 1 > … > σ_T = 0`` and window start ``i``:

* one shared initial noise ``x_0`` per tree (``policy.initial_noise`` with the run's rollout generator);
* steps ``t < i``: deterministic Euler ODE steps of the whole frontier (every tree of every group, one batched
  forward per step, chunked by ``chunk_size`` rows);
* steps ``t ∈ [i, i+d)``: every frontier node is evaluated **once**, then ``k`` children are drawn around the same
  step Gaussian ``N(μ, s²I)`` of the SDE kernel; each child edge records ``log π_old`` and is trainable;
* steps ``t ≥ i+d``: the tail, ODE steps of all ``k^d`` leaves of every tree (batched; :mod:`rlpost.ops.trees.tails`);
* the final states (``σ_T = 0``) are decoded and scored.

Topology choice (documented in ``docs/algorithms/treegrpo.md``): **every** step is recorded as an edge, so the node
table runs root → trunk → window → leaf → tail → decoded sample. Trunk and tail edges are ``trainable=False`` with
the ``"ode"`` kernel (NaN log-prob); each such node has a single child, so the backup passes advantages through them
unchanged. This keeps the decoded sample linked to its window leaf without any side table, at the cost of storing
``k^d·(T-i-d)`` tail states per tree (CPU memory; see the docs).

The window start is set once per training step in :meth:`TreeSampler.begin_step` (drawn with the step's generator
from the law in :mod:`rlpost.ops.trees.window`, or the step's position on the ``progressive`` schedule), so every group
and every rank of a step shares it and each step is one batched forward. It is published once: logged as the
rollout statistic ``tree/window_start``; in-process readers (the bench) use the public :attr:`TreeSampler.window_start`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
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
    WindowLaw,
    branch_children,
    evaluate_edges,
    expected_value,
    frontier_velocity,
    make_kernel,
    num_starts,
    tail_nfe,
    tail_problems,
    tail_sigmas,
    window_law_problems,
    window_law_probs,
    window_law_repr,
    window_law_start,
)

__all__ = ["TreeSampler"]

SDEKernelName = Literal["flow-sde", "dance-sde", "cps"]


class TreeSampler(Sampler):
    """TreeGRPO's sparse search tree: ``k`` children per frontier node inside one random SDE window of depth ``d``.

    Args:
        num_steps: Schedule length ``T`` (NFE per trajectory; the paper fixes 10).
        k: Children per frontier node inside the window (branching factor; paper default 3).
        depth: Window length ``d`` = tree depth; leaves per tree ``k^d`` (paper default 3). Must be ``<= T-1``.
        window: Window-start law: ``"geometric"`` (paper), ``"uniform"`` (Flow-GRPO-Fast style), ``"fixed"`` or
            ``"progressive"`` (the official code's schedule: from step 0, one shift every ``shift_interval`` steps).
        ratio: ``r`` of the truncated geometric law ``P(i) = (1-r)·r^i / (1-r^(T-d))`` (paper default 0.5).
        fixed_start: Window start for ``window: fixed`` (``0 … T-d-1``).
        shift_interval: ``window: progressive``: training steps between window shifts (``null`` = 50, upstream's
            ``tou``).
        stride: ``window: progressive``: steps the window start moves by at each shift (``null`` = 1, upstream).
        roll_back: ``window: progressive``: after the last start ``T-d-1``, restart at 0 (``null`` = true) instead of
            staying there.
        kernel: SDE kernel inside the window (``"flow-sde"``, ``"dance-sde"`` or ``"cps"``); the paper does not
            name its SDE, Flow-GRPO's is the default (``docs/design.md``, "Choices where the sources are silent").
        kernel_args: Constructor arguments of ``kernel`` (e.g. ``{noise_level: 0.7}`` for flow-sde, ``{eta: 0.3}``
            for dance-sde); ``null`` uses the kernel's defaults.
        logprob_reduction: ``"mean"`` (per-element mean, every anchor codebase) or ``"sum"`` over latent elements;
            it sets both the PPO ratio and the backup softmax's sharpness (``docs/models.md``, "Log-prob reduction").
        trees_per_prompt: Trees (independent initial noises) per prompt group; leaves of all trees of a prompt form
            one normalisation group.
        chunk_size: Maximum rows per transformer forward and per VAE decode (a memory budget; results do not
            depend on it beyond floating-point batch effects).
        ode_kernel: Deterministic kernel outside the window (only ``"ode"``, the Euler step, is supported).
        tail: How leaves go from the window's end to ``σ = 0`` (beyond the paper: :mod:`rlpost.ops.trees.tails`).
            ``"full"`` (the paper's and the official code's): one Euler ODE step per remaining step of the run's
            grid. ``"euler"``: Euler steps on the tail grid below. ``"dpm-solver++"``: multistep DPM-Solver++ (2M,
            data prediction; order 1 at the tail's first and final step) on the tail grid, as MixGRPO-Flash.
        tail_steps: Transformer evaluations per leaf in the tail: ``min(tail_steps, T-i-d)`` (``null``: every
            remaining step, ``T-i-d``). Only with ``tail`` ``"euler"`` or ``"dpm-solver++"``.
        tail_grid: ``"run"``: ``tail_steps`` evenly spread points of the run's own remaining grid (end points kept);
            ``"compressed"``: MixGRPO-Flash's fresh time-shifted grid from the window's end to 0 (needs
            ``tail_steps``; its shift is ``tail_shift``).
        tail_shift: Time shift of the ``compressed`` tail grid (SD3/SD3.5's scheduler shift is 3.0).
    """

    name: ClassVar[str] = "tree"
    provides: ClassVar[frozenset[str]] = frozenset({TREE, CLEAN_SAMPLES, EDGE_LOG_PROBS})

    def __init__(
        self,
        num_steps: Annotated[int, Range(ge=2)] = 10,
        k: Annotated[int, Range(ge=2)] = 3,
        depth: Annotated[int, Range(ge=1)] = 3,
        window: WindowLaw = "geometric",
        ratio: Annotated[float, Range(gt=0, lt=1)] = 0.5,
        fixed_start: Annotated[int, Range(ge=0)] | None = None,
        shift_interval: Annotated[int, Range(ge=1)] | None = None,
        stride: Annotated[int, Range(ge=1)] | None = None,
        roll_back: bool | None = None,
        kernel: SDEKernelName = "flow-sde",
        kernel_args: dict[str, Any] | None = None,
        logprob_reduction: LogProbReduction = "mean",
        trees_per_prompt: Annotated[int, Range(ge=1)] = 1,
        chunk_size: Annotated[int, Range(ge=1)] = 64,
        ode_kernel: Literal["ode"] = "ode",
        tail: TailSolver = "full",
        tail_steps: Annotated[int, Range(ge=1)] | None = None,
        tail_grid: TailGrid = "run",
        tail_shift: Annotated[float, Range(gt=0)] = 3.0,
    ) -> None:
        self.num_steps = int(num_steps)
        self.k = int(k)
        self.depth = int(depth)
        self.window: WindowLaw = window
        self.ratio = float(ratio)
        self.fixed_start = fixed_start
        self.shift_interval = shift_interval
        self.stride = stride
        self.roll_back = roll_back
        self.kernel = kernel
        self.kernel_args: dict[str, Any] = dict(kernel_args or {})
        self.logprob_reduction: LogProbReduction = logprob_reduction
        self.trees_per_prompt = int(trees_per_prompt)
        self.chunk_size = int(chunk_size)
        self.ode_kernel = ode_kernel
        self.tail: TailSolver = tail
        self.tail_steps = None if tail_steps is None else int(tail_steps)
        self.tail_grid: TailGrid = tail_grid
        self.tail_shift = float(tail_shift)
        self._kernels: list[StepKernel | None] | None = None
        self.window_start: int | None = None  # this step's start, set by begin_step

    # ------------------------------------------------------------------------------------------ configuration

    @property
    def kernel_names(self) -> list[str]:
        """Names aligned with ``Rollout.kernels``: index 0 the window's SDE kernel, index 1 the ODE kernel, and
        index 2 the DPM-Solver++ tail (only with ``tail: dpm-solver++``)."""
        names: list[str] = [self.kernel, self.ode_kernel]
        return names + [DPM_TAIL_KERNEL] if self.tail == "dpm-solver++" else names

    @property
    def kernels(self) -> list[StepKernel | None]:
        """Kernel objects aligned with :attr:`kernel_names` (built on first use; ``None`` for the multistep
        DPM-Solver++ tail, which the rollout runs itself and :meth:`evaluate` never sees)."""
        if self._kernels is None:
            built: list[StepKernel | None] = [
                make_kernel(self.kernel, **self.kernel_args),
                make_kernel(self.ode_kernel),
            ]
            self._kernels = built + [None] if self.tail == "dpm-solver++" else built
        return self._kernels

    def tail_nfe(self, start: int) -> int:
        """Transformer evaluations per leaf after a window starting at ``start``: ``min(tail_steps, T-i-d)``."""
        return tail_nfe(self.num_steps - start - self.depth, self.tail_steps)

    def schedule(self, sigmas: Tensor, start: int) -> Tensor:
        """The rollout's noise levels for window start ``start``: the run's grid up to the window's end, then the tail.

        With ``tail: full`` (or a tail of every remaining step on the ``run`` grid) this is ``sigmas`` itself, so the
        paper preset is unchanged bit for bit. Otherwise the ``tail_nfe(start)`` tail steps follow ``tail_grid``;
        node ``step`` indices then index this table (``Rollout.sigmas``), as for MixGRPO-Flash's tail.
        """
        sigmas = sigmas.detach().float().cpu()
        end = start + self.depth
        return tail_sigmas(sigmas, self.num_steps, end, self.tail_nfe(start), self.tail_grid, self.tail_shift)

    def window_probs(self) -> Tensor:
        """``[T-d]`` float64 probability of each window start under the configured law (for ``progressive``: the
        share of steps spent at each start over one pass of the schedule)."""
        return window_law_probs(self)

    def validate(self, recipe: Any) -> list[str]:
        """Check what the argument ranges (checked at construction) cannot: the window fits the schedule, the window
        law's and the tail's settings agree, and the kernel (every problem names its field)."""
        problems: list[str] = []
        p = "sampler.init_args"
        if self.depth > self.num_steps - 1:
            problems.append(
                f"{p}.depth: must be in [1, num_steps - 1] = [1, {self.num_steps - 1}] so the window fits before the "
                f"last step (starts 0 … T-d-1), got {self.depth}"
            )
        problems += window_law_problems(p, self)
        problems += tail_problems(p, self.tail, self.tail_steps, self.tail_grid)
        try:
            kernels = self.kernels
        except (TypeError, ValueError) as exc:
            problems.append(f"{p}.kernel_args: cannot build kernel {self.kernel!r}: {exc}")
        else:
            if kernels[0] is None or not kernels[0].stochastic:
                problems.append(f"{p}.kernel: the window kernel must be stochastic, got {self.kernel!r}")
        return problems

    # ------------------------------------------------------------------------------------------------ counts

    def _per_tree_window_forwards(self) -> int:
        """``Σ_{j<d} k^j``: window frontier nodes per tree (one forward each; the paper's "effective steps")."""
        return sum(int(self.k**j) for j in range(self.depth))

    def rollout_forwards_at(self, start: int, num_groups: int) -> int:
        """Rollout transformer rows for window start ``start``: ``G·trees·(i + Σ_{j<d} k^j + k^d·n_tail(i))`` with
        ``n_tail(i) = T-i-d`` for the full tail, ``min(tail_steps, T-i-d)`` for a shortened one (:meth:`tail_nfe`)."""
        trees = num_groups * self.trees_per_prompt
        return trees * (start + self._per_tree_window_forwards() + int(self.k**self.depth) * self.tail_nfe(start))

    def expected_rollout_forwards(self, num_groups: int, samples_per_group: int = 1) -> float:
        """Rollout transformer rows averaged over the window law (non-integer in general); ``samples_per_group``
        is ignored, as in :meth:`counts`."""
        starts = torch.arange(num_starts(self.num_steps, self.depth))
        values = torch.tensor([self.rollout_forwards_at(int(s), num_groups) for s in starts], dtype=torch.float64)
        return expected_value(self.window_probs(), values)

    def counts(self, num_groups: int, samples_per_group: int) -> StepCounts:
        """Closed-form per-step counts; ``samples_per_group`` is ignored (leaves per prompt = ``trees·k^d``).

        ``rollout_forwards`` is the **worst case** over the window law's support (for the full tail the earliest
        start, since every later start replaces ``k^d - 1`` tail rows by one trunk row; a capped tail can make a
        later start dearer, so the maximum is taken), exact for ``window: fixed``; :meth:`expected_rollout_forwards`
        gives the expectation and :meth:`rollout_forwards_at` the count of a given start.
        """
        trees = num_groups * self.trees_per_prompt
        if self.window == "fixed" and self.fixed_start is not None:
            worst = self.rollout_forwards_at(self.fixed_start, num_groups)
        elif self.depth > self.num_steps - 1:  # no window fits: validate() reports it; counts stay defined for it
            worst = self.rollout_forwards_at(0, num_groups)
        else:
            support = (self.window_probs() > 0).nonzero().flatten().tolist()
            worst = max(self.rollout_forwards_at(int(i), num_groups) for i in support)
        return StepCounts(
            images=trees * self.k**self.depth,
            trainable_edges=trees * sum(self.k**j for j in range(1, self.depth + 1)),
            rollout_forwards=worst,
            train_forwards=trees * self._per_tree_window_forwards(),
        )

    def step_counts(self, num_groups: int, samples_per_group: int) -> StepCounts:
        """:meth:`counts` with the rollout rows at the window start :meth:`begin_step` set (the worst case before
        the first step)."""
        worst = self.counts(num_groups, samples_per_group)
        if self.window_start is None:
            return worst
        return replace(worst, rollout_forwards=self.rollout_forwards_at(self.window_start, num_groups))

    # ----------------------------------------------------------------------------------------------- rollout

    def begin_step(self, step: int, generator: torch.Generator) -> None:
        """Set the step's window start: one draw from the law with the step's ``generator`` (one uniform), or the
        step's position on the ``progressive`` schedule (no draw). Every group and rank of the step shares it."""
        self.window_start = window_law_start(self, step, generator)

    def rollout(self, policy: Policy, batch: PromptBatch, generator: torch.Generator) -> Rollout:
        """Grow one tree per (prompt, tree index) with the step's window, decode its leaves and record every step as
        an edge.

        RNG order on ``generator``: the initial noises ``[G·trees, ...]``, then for each window step one
        ``[F·k, ...]`` block of standard normals (``F`` = frontier size, parents in order, children of a parent
        adjacent). The tail draws nothing.

        Raises:
            RuntimeError: When :meth:`begin_step` has not set the step's window start.
        """
        return self._grow(policy, batch, SharedNoise(generator, batch.num_groups))

    def rollout_groups(self, policy: Policy, batch: PromptBatch, generators: Sequence[torch.Generator]) -> Rollout:
        """All of ``batch``'s groups in one forward per depth, group ``j`` drawing its noise from ``generators[j]``.

        Group ``j``'s rows are a contiguous block of every frontier (trees of a group adjacent, children of a parent
        adjacent), and each group draws from its own generator exactly what :meth:`rollout` of that group alone
        draws, so the leaves equal those of one :meth:`rollout` per group (up to floating-point batch effects of
        the larger forwards) while the transformer runs ``G`` times fewer, larger batches.

        Raises:
            ValueError: When the number of generators differs from the number of groups.
            RuntimeError: When :meth:`begin_step` has not set the step's window start.
        """
        if len(generators) != batch.num_groups:
            raise ValueError(f"rollout_groups: {batch.num_groups} groups but {len(generators)} generators")
        return self._grow(policy, batch, PerGroupNoise(list(generators)))

    def _grow(self, policy: Policy, batch: PromptBatch, noise: NoiseSource) -> Rollout:
        if self.window_start is None:
            raise RuntimeError(
                "TreeSampler.rollout: no window start; call begin_step(step, generator) first (the runner does, once "
                "per training step)"
            )
        k, depth = self.k, self.depth
        start = self.window_start
        end = start + depth
        sde, ode = self.kernels[0], self.kernels[1]
        assert sde is not None and ode is not None  # built by make_kernel; only the DPM tail entry is None
        sigmas = self.schedule(policy.sigmas(self.num_steps), start)
        total = sigmas.shape[0] - 1  # trunk + window + tail steps
        device = policy.device
        builder = RolloutBuilder(batch, sigmas, self.kernel_names)
        cond = policy.encode(batch.prompts)
        groups = torch.arange(batch.num_groups).repeat_interleave(self.trees_per_prompt)
        x = noise.initial(policy, self.trees_per_prompt).to(device, torch.float32)
        ids = builder.add_nodes(x, 0, groups)
        forwards = calls = 0
        tail = TailStepper(self.tail, ode, self.logprob_reduction)
        for t in range(total):
            f = x.shape[0]
            sigma = sigmas[t].to(device).expand(f)
            sigma_next = sigmas[t + 1].to(device).expand(f)
            # One forward per frontier node, inside and outside the window (arXiv 2512.08153, Sec. "Method").
            v = frontier_velocity(policy, x, sigma, cond, groups, self.chunk_size)
            forwards += f
            calls += -(-f // self.chunk_size)
            if start <= t < end:
                # k children around the *same* step Gaussian: repeat parent rows, one noise block for all children.
                z = noise.normal(f * k // batch.num_groups, x.shape[1:]).to(device)
                out = branch_children(sde, x, v, sigma, sigma_next, k, z, self.logprob_reduction)
                parents, groups = ids.repeat_interleave(k), groups.repeat_interleave(k)
                x_next, log_prob, trainable, kernel_index = out.next_latents, out.log_prob, True, 0
            elif t >= end:  # the leaves' tail (rlpost.ops.trees.tails)
                x_next, log_prob, kernel_index = tail.step(x, v, sigma, sigma_next)
                parents, trainable = ids, False
            else:  # the trunk: Euler ODE steps
                out = ode.step(x, v, sigma, sigma_next, None, self.logprob_reduction)
                x_next, log_prob = out.next_latents, out.log_prob
                parents, trainable, kernel_index = ids, False, 1
            x = x_next
            ids = builder.add_nodes(x, t + 1, groups)
            builder.add_edges(parents, ids, log_prob, trainable, kernel_index)
        media = torch.cat([policy.decode(x[c : c + self.chunk_size]) for c in range(0, x.shape[0], self.chunk_size)])
        stats = {
            "tree/window_start": float(start),
            "tree/leaves": float(x.shape[0]),
            "tree/window_edges": float(self.counts(batch.num_groups, 1).trainable_edges),
            "tree/tail_steps": float(total - end),
            "perf/rollout_forwards": float(forwards),
            "perf/rollout_calls": float(calls),
        }
        return builder.build(ids, media, stats)

    def evaluate(self, policy: Policy, rollout: Rollout, edges: Tensor) -> EdgeEval:
        """Recompute the window edges' log-probs with one forward per parent (the shared :func:`evaluate_edges`).

        Window edges keep their schedule indices whatever the tail (the tail only appends levels after the window),
        so ``rollout.sigmas[step]`` and ``[step + 1]`` are the window step's levels."""
        if rollout.kernels != self.kernel_names:
            raise ValueError(f"rollout kernels {rollout.kernels} do not match this sampler's {self.kernel_names}")
        return evaluate_edges(policy, rollout, edges, self.kernels, self.logprob_reduction)

    def __repr__(self) -> str:
        return (
            f"TreeSampler(T={self.num_steps}, k={self.k}, d={self.depth}, {window_law_repr(self)}, "
            f"kernel={self.kernel!r}{self.kernel_args or ''}, reduction={self.logprob_reduction!r}, "
            f"trees={self.trees_per_prompt}"
            + (
                ""
                if self.tail == "full"
                else f", tail={self.tail!r}, tail_steps={self.tail_steps}, tail_grid={self.tail_grid!r}"
            )
            + ")"
        )
