"""TreeGRPO's tree sampler: an ODE trunk, one ``k``-ary SDE window of depth ``d``, ODE tails (Ding & Ye,
arXiv 2512.08153, Sec. "Method").

Per prompt group and tree, with schedule ``σ_0 = 1 > … > σ_T = 0`` and window start ``i``:

* one shared initial noise ``x_0`` per tree (``policy.initial_noise`` with the run's rollout generator);
* steps ``t < i``: deterministic Euler ODE steps of the whole frontier (every tree of every group, one batched
  forward per step, chunked by ``chunk_size`` rows);
* steps ``t ∈ [i, i+d)``: every frontier node is evaluated **once**, then ``k`` children are drawn around the same
  step Gaussian ``N(μ, s²I)`` of the SDE kernel; each child edge records ``log π_old`` and is trainable;
* steps ``t ≥ i+d``: ODE steps of all ``k^d`` leaves of every tree (batched);
* the final states (``σ_T = 0``) are decoded and scored.

Topology choice (documented in ``docs/algorithms/treegrpo.md``): **every** step is recorded as an edge, so the node
table runs root → trunk → window → leaf → tail → decoded sample. Trunk and tail edges are ``trainable=False`` with
the ``"ode"`` kernel (NaN log-prob); each such node has a single child, so the backup passes advantages through them
unchanged. This keeps the decoded sample linked to its window leaf without any side table, at the cost of storing
``k^d·(T-i-d)`` tail states per tree (CPU memory; see the docs).

The window start is set once per training step in :meth:`TreeSampler.begin_step` (drawn with the step's generator
from the law in :mod:`rlpost_treegrpo.window`, or the step's position on the ``progressive`` schedule), so every group
and every rank of a step shares it and each step is one batched forward; it is stored in
``rollout.stash[WINDOW_START]``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from rlpost import (
    EdgeEval,
    LogProbReduction,
    Policy,
    PromptBatch,
    Rollout,
    RolloutBuilder,
    Sampler,
    StashKey,
    StepCounts,
    StepKernel,
    evaluate_edges,
    frontier_velocity,
    make_kernel,
)
from rlpost_treegrpo.window import (
    WindowLaw,
    draw_window_start,
    expected_value,
    num_starts,
    progressive_start,
    window_probs,
)

__all__ = ["WINDOW_START", "TreeSampler"]

WINDOW_START: StashKey[int] = StashKey("treegrpo.window_start")
"""Stash key of the rollout's window start ``i`` (the window is steps ``i … i+d-1``)."""

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
    """

    name: ClassVar[str] = "tree"
    provides: ClassVar[frozenset[str]] = frozenset({"tree"})

    def __init__(
        self,
        num_steps: int = 10,
        k: int = 3,
        depth: int = 3,
        window: WindowLaw = "geometric",
        ratio: float = 0.5,
        fixed_start: int | None = None,
        shift_interval: int | None = None,
        stride: int | None = None,
        roll_back: bool | None = None,
        kernel: SDEKernelName = "flow-sde",
        kernel_args: dict[str, Any] | None = None,
        logprob_reduction: LogProbReduction = "mean",
        trees_per_prompt: int = 1,
        chunk_size: int = 64,
        ode_kernel: Literal["ode"] = "ode",
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
        self._kernels: list[StepKernel] | None = None
        self.window_start: int | None = None  # this step's start, set by begin_step

    # ------------------------------------------------------------------------------------------ configuration

    @property
    def kernel_names(self) -> list[str]:
        """Names aligned with ``Rollout.kernels``: index 0 the window's SDE kernel, index 1 the ODE kernel."""
        return [self.kernel, self.ode_kernel]

    @property
    def kernels(self) -> list[StepKernel]:
        """Kernel objects aligned with :attr:`kernel_names` (built on first use)."""
        if self._kernels is None:
            self._kernels = [make_kernel(self.kernel, **self.kernel_args), make_kernel(self.ode_kernel)]
        return self._kernels

    _PROGRESSIVE_DEFAULTS: ClassVar[dict[str, Any]] = {"shift_interval": 50, "stride": 1, "roll_back": True}

    def _progressive(self, name: str) -> Any:
        """A ``progressive`` setting, or upstream's default when it is ``null``."""
        value = getattr(self, name)
        return self._PROGRESSIVE_DEFAULTS[name] if value is None else value

    def window_probs(self) -> Tensor:
        """``[T-d]`` float64 probability of each window start under the configured law (for ``progressive``: the
        share of steps spent at each start over one pass of the schedule)."""
        return window_probs(
            self.num_steps,
            self.depth,
            self.window,
            self.ratio,
            self.fixed_start,
            stride=int(self._progressive("stride")),
            roll_back=bool(self._progressive("roll_back")),
        )

    def validate(self, recipe: Any) -> list[str]:
        """Check the tree shape, the window law and the kernel (every problem names its field)."""
        problems: list[str] = []
        p = "sampler.init_args"
        if self.num_steps < 2:
            problems.append(f"{p}.num_steps: must be >= 2, got {self.num_steps}")
        if self.k < 2:
            problems.append(f"{p}.k: must be >= 2 (k = 1 is a chain, not a tree), got {self.k}")
        if self.depth < 1 or self.depth > self.num_steps - 1:
            problems.append(
                f"{p}.depth: must be in [1, num_steps - 1] = [1, {self.num_steps - 1}] so the window fits before the "
                f"last step (starts 0 … T-d-1), got {self.depth}"
            )
        if self.window == "geometric" and not 0.0 < self.ratio < 1.0:
            problems.append(f"{p}.ratio: must be in (0, 1), got {self.ratio}")
        if self.window == "fixed":
            hi = num_starts(self.num_steps, self.depth) - 1
            if self.fixed_start is None or not 0 <= self.fixed_start <= hi:
                problems.append(f"{p}.fixed_start: window 'fixed' needs a start in [0, {hi}], got {self.fixed_start}")
        elif self.fixed_start is not None:
            problems.append(f"{p}.fixed_start: only used with window 'fixed' (window is {self.window!r})")
        if self.window == "progressive":
            if int(self._progressive("shift_interval")) < 1:
                problems.append(f"{p}.shift_interval: must be >= 1 training step, got {self.shift_interval}")
            if int(self._progressive("stride")) < 1:
                problems.append(f"{p}.stride: must be >= 1 (use window 'fixed' for a frozen window), got {self.stride}")
        else:
            for name in ("shift_interval", "stride", "roll_back"):
                if getattr(self, name) is not None:
                    problems.append(f"{p}.{name}: only used with window 'progressive' (window is {self.window!r})")
        if self.window not in ("geometric", "uniform", "fixed", "progressive"):
            problems.append(
                f"{p}.window: must be 'geometric', 'uniform', 'fixed' or 'progressive', got {self.window!r}"
            )
        if self.trees_per_prompt < 1:
            problems.append(f"{p}.trees_per_prompt: must be >= 1, got {self.trees_per_prompt}")
        if self.chunk_size < 1:
            problems.append(f"{p}.chunk_size: must be >= 1, got {self.chunk_size}")
        try:
            kernels = self.kernels
        except (TypeError, ValueError) as exc:
            problems.append(f"{p}.kernel_args: cannot build kernel {self.kernel!r}: {exc}")
        else:
            if not kernels[0].stochastic:
                problems.append(f"{p}.kernel: the window kernel must be stochastic, got {self.kernel!r}")
        return problems

    # ------------------------------------------------------------------------------------------------ counts

    def _per_tree_window_forwards(self) -> int:
        """``Σ_{j<d} k^j``: window frontier nodes per tree (one forward each; the paper's "effective steps")."""
        return sum(int(self.k**j) for j in range(self.depth))

    def rollout_forwards_at(self, start: int, num_groups: int) -> int:
        """Rollout transformer rows for window start ``start``: ``G·trees·(i + Σ_{j<d} k^j + k^d·(T-i-d))``."""
        trees = num_groups * self.trees_per_prompt
        tail = self.num_steps - start - self.depth
        return trees * (start + self._per_tree_window_forwards() + int(self.k**self.depth) * tail)

    def expected_rollout_forwards(self, num_groups: int, samples_per_group: int = 1) -> float:
        """Rollout transformer rows averaged over the window law (non-integer in general); ``samples_per_group``
        is ignored, as in :meth:`counts`."""
        starts = torch.arange(num_starts(self.num_steps, self.depth))
        values = torch.tensor([self.rollout_forwards_at(int(s), num_groups) for s in starts], dtype=torch.float64)
        return expected_value(self.window_probs(), values)

    def counts(self, num_groups: int, samples_per_group: int) -> StepCounts:
        """Closed-form per-step counts; ``samples_per_group`` is ignored (leaves per prompt = ``trees·k^d``).

        ``rollout_forwards`` is the **worst case** over the window law's support (the earliest admissible start,
        since every later start replaces ``k^d - 1`` tail rows by one trunk row), exact for ``window: fixed``;
        :meth:`expected_rollout_forwards` gives the expectation.
        """
        trees = num_groups * self.trees_per_prompt
        worst = self.fixed_start if (self.window == "fixed" and self.fixed_start is not None) else 0
        return StepCounts(
            images=trees * self.k**self.depth,
            trainable_edges=trees * sum(self.k**j for j in range(1, self.depth + 1)),
            rollout_forwards=self.rollout_forwards_at(worst, num_groups),
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
        if self.window == "progressive":
            self.window_start = progressive_start(
                step,
                self.num_steps,
                self.depth,
                int(self._progressive("shift_interval")),
                int(self._progressive("stride")),
                bool(self._progressive("roll_back")),
            )
        else:
            self.window_start = draw_window_start(self.window_probs(), generator)

    def rollout(self, policy: Policy, batch: PromptBatch, generator: torch.Generator) -> Rollout:
        """Grow one tree per (prompt, tree index) with the step's window, decode its leaves and record every step as
        an edge.

        RNG order on ``generator``: the initial noises ``[G·trees, ...]``, then for each window step one
        ``[F·k, ...]`` block of standard normals (``F`` = frontier size, parents in order, children of a parent
        adjacent).

        Raises:
            RuntimeError: When :meth:`begin_step` has not set the step's window start.
        """
        if self.window_start is None:
            raise RuntimeError(
                "TreeSampler.rollout: no window start; call begin_step(step, generator) first (the runner does, once "
                "per training step)"
            )
        steps, k, depth = self.num_steps, self.k, self.depth
        start = self.window_start
        sde, ode = self.kernels
        sigmas = policy.sigmas(steps)
        device = policy.device
        builder = RolloutBuilder(batch, sigmas, self.kernel_names)
        cond = policy.encode(batch.prompts)
        groups = torch.arange(batch.num_groups).repeat_interleave(self.trees_per_prompt)
        x = policy.initial_noise(groups.shape[0], generator).to(device, torch.float32)
        ids = builder.add_nodes(x, 0, groups)
        forwards = 0
        for t in range(steps):
            f = x.shape[0]
            sigma = sigmas[t].to(device).expand(f)
            sigma_next = sigmas[t + 1].to(device).expand(f)
            # One forward per frontier node, inside and outside the window (arXiv 2512.08153, Sec. "Method").
            v = frontier_velocity(policy, x, sigma, cond, groups, self.chunk_size)
            forwards += f
            if start <= t < start + depth:
                # k children around the *same* step Gaussian: repeat parent rows, one noise block for all children.
                noise = torch.randn(
                    (f * k, *x.shape[1:]), generator=generator, device=generator.device, dtype=torch.float32
                ).to(device)
                out = sde.step(
                    x.repeat_interleave(k, 0),
                    v.repeat_interleave(k, 0),
                    sigma.repeat_interleave(k, 0),
                    sigma_next.repeat_interleave(k, 0),
                    None,
                    self.logprob_reduction,
                    noise=noise,
                )
                parents, groups = ids.repeat_interleave(k), groups.repeat_interleave(k)
                trainable, kernel_index = True, 0
            else:
                out = ode.step(x, v, sigma, sigma_next, None, self.logprob_reduction)
                parents, trainable, kernel_index = ids, False, 1
            x = out.next_latents
            ids = builder.add_nodes(x, t + 1, groups)
            builder.add_edges(parents, ids, out.log_prob, trainable, kernel_index)
        images = torch.cat([policy.decode(x[c : c + self.chunk_size]) for c in range(0, x.shape[0], self.chunk_size)])
        stats = {
            "tree/window_start": float(start),
            "tree/leaves": float(x.shape[0]),
            "tree/window_edges": float(self.counts(batch.num_groups, 1).trainable_edges),
            "perf/rollout_forwards": float(forwards),
        }
        rollout = builder.build(ids, images, stats)
        rollout.stash[WINDOW_START] = start
        return rollout

    def evaluate(self, policy: Policy, rollout: Rollout, edges: Tensor) -> EdgeEval:
        """Recompute the window edges' log-probs with one forward per parent (the shared :func:`evaluate_edges`)."""
        if rollout.kernels != self.kernel_names:
            raise ValueError(f"rollout kernels {rollout.kernels} do not match this sampler's {self.kernel_names}")
        return evaluate_edges(policy, rollout, edges, self.kernels, self.logprob_reduction)

    def __repr__(self) -> str:
        law = (
            f"window='progressive', every={self._progressive('shift_interval')}, stride={self._progressive('stride')}"
            f", roll_back={self._progressive('roll_back')}"
            if self.window == "progressive"
            else f"window={self.window!r}, r={self.ratio}"
        )
        return (
            f"TreeSampler(T={self.num_steps}, k={self.k}, d={self.depth}, {law}, "
            f"kernel={self.kernel!r}{self.kernel_args or ''}, reduction={self.logprob_reduction!r}, "
            f"trees={self.trees_per_prompt})"
        )
