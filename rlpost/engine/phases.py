"""Wall time per phase of a training step: the runner's documented timing context.

:class:`rlpost.engine.runner.Runner` owns one :class:`PhaseTimer` (``runner.phases``) and wraps each phase of
:meth:`~rlpost.engine.runner.Runner.step` in it: ``rollout`` (next prompt batch, the sampler's rollout with its
transformer forwards and VAE decode, the log-prob guard), ``reward`` (every training reward), ``advantage`` (the
estimator) and ``update`` (the update rule: training forwards, backward, optimizer steps).
:meth:`~rlpost.engine.runner.Runner.evaluate` is timed as ``eval``, loading the model and the rewards in
:meth:`~rlpost.engine.runner.Runner.setup` as ``load`` and :meth:`~rlpost.engine.runner.Runner.save_checkpoint` as
``checkpoint``. Lifecycle hooks, gathering and bookkeeping between phases belong to no phase.

A :class:`PhaseListener` appended to :attr:`PhaseTimer.listeners` is told when each phase starts and ends: the command
line shows the phases that way (``rlpost.apps.progress``) without the runner printing anything.

Readers (``rlpost bench``, a profiling plugin, the runner's own ``perf/<phase>_sec`` metrics) take
:attr:`PhaseTimer.current` after a step, or difference two :meth:`PhaseTimer.snapshot` calls around any stretch;
nothing outside the runner needs to wrap or replace a component's method to see where a step's time goes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch

__all__ = ["STEP_PHASES", "PhaseListener", "PhaseTimer"]

STEP_PHASES = ("rollout", "reward", "advantage", "update")
"""The phases of one training step, in the order the runner enters them."""


class PhaseListener(Protocol):
    """Told when a timed phase starts and ends (a progress display, a profiler)."""

    def phase_started(self, phase: str) -> None:
        """``phase`` begins."""

    def phase_ended(self, phase: str, seconds: float, ok: bool) -> None:
        """``phase`` ended after ``seconds``; ``ok`` is false when it raised."""


class PhaseTimer:
    """Accumulated wall seconds per named phase.

    Args:
        sync_cuda: Synchronise CUDA at both ends of every timed block, so asynchronous kernels are charged to the
            phase that launched them. Off by default: a training run should not stall its GPU queue for a metric;
            a benchmark that compares phases turns it on (``runner.phases.sync_cuda = True``).

    Attributes:
        totals: Seconds per phase since the timer was created.
        current: Seconds per phase since the last :meth:`start_step` (the runner calls it at the start of every
            step, so right after a step it holds that step's phases; a phase the step skipped is absent, and an
            evaluation run between steps adds ``eval``).
        listeners: Told when each phase starts and ends, in order.
    """

    def __init__(self, sync_cuda: bool = False) -> None:
        self.sync_cuda = sync_cuda
        self.listeners: list[PhaseListener] = []
        self.totals: dict[str, float] = {}
        self.current: dict[str, float] = {}
        self._step_start = time.perf_counter()

    def start_step(self) -> None:
        """Begin a new step: clear :attr:`current` and restart :meth:`step_elapsed`."""
        self.current = {}
        self._step_start = time.perf_counter()

    def step_elapsed(self) -> float:
        """Seconds since the last :meth:`start_step`."""
        return time.perf_counter() - self._step_start

    def snapshot(self) -> dict[str, float]:
        """A copy of :attr:`totals` (difference two of them to time any stretch)."""
        return dict(self.totals)

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Charge the enclosed block to ``phase`` (also when it raises)."""
        if self.sync_cuda:
            torch.cuda.synchronize()
        for listener in self.listeners:
            listener.phase_started(phase)
        t0 = time.perf_counter()
        ok = False
        try:
            yield
            ok = True
        finally:
            if self.sync_cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            self.totals[phase] = self.totals.get(phase, 0.0) + seconds
            self.current[phase] = self.current.get(phase, 0.0) + seconds
            for listener in self.listeners:
                listener.phase_ended(phase, seconds, ok)
