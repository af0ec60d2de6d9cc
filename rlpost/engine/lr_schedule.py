"""A learning-rate schedule over the run's length: :class:`RunLengthLR`.

torch's schedulers count optimizer steps (``LinearLR(total_iters=...)``, ``PolynomialLR``, ``CosineAnnealingLR``), so a
schedule that should end with the run needs its length in optimizer steps, which the recipe author has to work out
from ``run.max_steps`` and the update rule's layout, or guess for a time budget (``recipes/bench/digits/
lr_decay_*.yaml`` hard-code 200 and 500). :class:`RunLengthLR`'s factor is a function of the run's *progress*
instead: the fraction of ``run.max_steps`` done (``over: steps``) or of a training-time budget spent (``over: time``).
The runner tells it the progress before each training step (:func:`begin_step`) and the step's wall seconds after it
(:func:`end_step`, the slowest rank's under ``distributed``); within a step the learning rate is constant, whatever the
number of optimizer steps (the backend's and DeepSpeed's ``scheduler.step()`` recompute the same value).

Resume is exact: over steps, the progress is a function of the restored step; over time, the training seconds spent
so far are part of the scheduler's ``state_dict`` (saved in every checkpoint with the torch optimizer's state).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch.optim.lr_scheduler import LRScheduler

__all__ = ["RunLengthAware", "RunLengthLR", "begin_step", "bind_time_budget", "end_step", "is_run_length_lr"]

FIELD = "lr_scheduler.init_args"
"""Where the schedule's arguments live in a recipe (its problems name ``lr_scheduler.init_args.<argument>``)."""

SHAPES = ("linear", "cosine", "constant")
OVER = ("steps", "time")


@runtime_checkable
class RunLengthAware(Protocol):
    """What the runner tells a scheduler about the run (any scheduler with these two methods is told)."""

    def begin_step(self, step: int, max_steps: int) -> None:
        """Training step ``step`` (0-based: the steps completed so far) of ``max_steps`` is about to run."""

    def end_step(self, seconds: float) -> None:
        """The training step just run took ``seconds`` of wall time."""


class RunLengthLR(LRScheduler):
    """Learning rate = the optimizer's learning rate × a factor of the run's progress ``p`` in [0, 1].

    ``p`` is ``step / (run.max_steps - 1)`` over steps (0 at the first training step, 1 at the last; 0 throughout a
    one-step run), or training seconds spent before the step / ``budget_s`` over time (capped at 1: the factor
    stays at ``final`` once the budget is spent). Training seconds are the steps' own wall time
    (``perf/step_sec``), not evaluation or checkpointing. The factor rises linearly from 0 to 1 over the first
    ``warmup`` of the run (the first step then trains at learning rate 0, as in transformers' warmup schedules),
    then follows ``shape`` from 1 to ``final`` over the rest (with ``q = (p - warmup) / (1 - warmup)``):

    * ``linear``: ``1 - (1 - final) q``;
    * ``cosine``: ``final + (1 - final)(1 + cos(pi q)) / 2`` (Loshchilov & Hutter, SGDR, arXiv 1608.03983, eq. 5,
      without restarts);
    * ``constant``: 1 (warmup only).

    Use it from a recipe (no ``total_iters`` to work out)::

        lr_scheduler:
          class_path: rlpost.RunLengthLR
          init_args: {shape: cosine, warmup: 0.05, final: 0.0}

    Args:
        optimizer: The torch optimizer (the recipe's ``torch_optimizer``); its learning rate is the peak.
        shape: ``linear``, ``cosine`` or ``constant`` after the warmup.
        warmup: Fraction of the run, in [0, 1), over which the factor ramps up from 0.
        final: Factor at the end of the run, in [0, 1] (default 0: the learning rate reaches 0). Not with
            ``constant``.
        over: ``steps`` (progress through ``run.max_steps``) or ``time`` (progress through ``budget_s``).
        budget_s: Training seconds the run is given, with ``over: time``. ``rlpost bench`` fills in its
            ``bench.time_budget_s`` when this is unset.

    Raises:
        ValueError: An argument is out of range or does not fit the others; the message names each field
            (``lr_scheduler.init_args.warmup: ...``).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        shape: Literal["linear", "cosine", "constant"] = "linear",
        warmup: float = 0.0,
        final: float | None = None,
        over: Literal["steps", "time"] = "steps",
        budget_s: float | None = None,
    ) -> None:
        problems = run_length_problems(shape, warmup, final, over, budget_s)
        if problems:
            raise ValueError("; ".join(problems))
        self.shape = shape
        self.warmup = float(warmup)
        self.final = 0.0 if final is None else float(final)
        self.over = over
        self.budget_s = None if budget_s is None else float(budget_s)
        # Run progress: the step about to run, the run's length and the training seconds spent (state_dict).
        self.step_index = 0
        self.max_steps = 1
        self.elapsed_s = 0.0
        super().__init__(optimizer)

    # The recipe's arguments are not state: a resume with changed ones follows the new schedule from its progress.
    _ARGS = ("shape", "warmup", "final", "over", "budget_s")

    def progress(self) -> float:
        """The run's progress in [0, 1] at the current step."""
        if self.over == "time":
            assert self.budget_s is not None
            return min(1.0, self.elapsed_s / self.budget_s)
        if self.max_steps <= 1:
            return 0.0
        return min(1.0, self.step_index / (self.max_steps - 1))

    def factor(self, p: float) -> float:
        """The learning-rate factor at progress ``p``."""
        if p < self.warmup:
            return p / self.warmup
        if self.shape == "constant":
            return 1.0
        q = (p - self.warmup) / (1.0 - self.warmup)
        if self.shape == "linear":
            return 1.0 - (1.0 - self.final) * q
        return self.final + (1.0 - self.final) * 0.5 * (1.0 + math.cos(math.pi * q))

    def get_lr(self) -> list[float | torch.Tensor]:
        """The optimizer's learning rates times :meth:`factor` of the current progress (the same for every
        optimizer step of a training step)."""
        f = self.factor(self.progress())
        return [float(base) * f for base in self.base_lrs]

    def _apply(self) -> None:
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        self._last_lr = lrs

    def begin_step(self, step: int, max_steps: int) -> None:
        """Set the learning rate for training step ``step`` (0-based) of a run of ``max_steps`` steps."""
        self.step_index, self.max_steps = int(step), int(max_steps)
        self._apply()

    def end_step(self, seconds: float) -> None:
        """Add the wall seconds of the training step just run to the training time spent (over time only: a
        schedule over steps keeps no wall time, so its state is the same in a re-run)."""
        if self.over == "time" and math.isfinite(seconds) and seconds > 0:
            self.elapsed_s += float(seconds)

    def state_dict(self) -> dict[str, Any]:
        """torch's scheduler state plus the run progress, without the recipe's arguments."""
        return {k: v for k, v in super().state_dict().items() if k not in self._ARGS}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (arguments stay as the recipe sets them now)."""
        super().load_state_dict({k: v for k, v in state_dict.items() if k not in self._ARGS})


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def run_length_problems(shape: Any, warmup: Any, final: Any, over: Any, budget_s: Any) -> list[str]:
    """Problems of :class:`RunLengthLR`'s arguments, each naming its recipe field (empty when they are sane)."""
    problems = []
    if shape not in SHAPES:
        problems.append(f"{FIELD}.shape: must be one of {', '.join(SHAPES)}, got {shape!r}")
    if over not in OVER:
        problems.append(f"{FIELD}.over: must be one of {', '.join(OVER)}, got {over!r}")
    if not (_number(warmup) and 0 <= warmup < 1):
        problems.append(f"{FIELD}.warmup: must be a fraction of the run in [0, 1), got {warmup!r}")
    if final is not None and not (_number(final) and 0 <= final <= 1):
        problems.append(f"{FIELD}.final: must be a factor in [0, 1] or null, got {final!r}")
    if final is not None and shape == "constant":
        problems.append(f"{FIELD}.final: has no effect with shape constant (remove it, or choose linear or cosine)")
    if budget_s is not None and not (_number(budget_s) and budget_s > 0):
        problems.append(f"{FIELD}.budget_s: must be a positive number of seconds or null, got {budget_s!r}")
    if over == "time" and budget_s is None:
        problems.append(
            f"{FIELD}.budget_s: over: time needs the run's training-time budget in seconds (rlpost bench sets its "
            "bench.time_budget_s)"
        )
    if over == "steps" and budget_s is not None:
        problems.append(f"{FIELD}.budget_s: only used with over: time (got over: steps)")
    return problems


def begin_step(scheduler: object, step: int, max_steps: int) -> None:
    """Tell a :class:`RunLengthAware` scheduler which training step is about to run (a no-op for others)."""
    if isinstance(scheduler, RunLengthAware):
        scheduler.begin_step(step, max_steps)


def end_step(scheduler: object, seconds: float, max_over_ranks: Callable[[float], float] | None = None) -> None:
    """Tell a :class:`RunLengthAware` scheduler how long the training step took (a no-op for others).

    ``max_over_ranks`` is the work split's (a collective under ``distributed``): every rank is then told the slowest
    rank's seconds, so the learning rate stays the same on every rank.
    """
    if isinstance(scheduler, RunLengthAware):
        if max_over_ranks is not None:
            seconds = max_over_ranks(seconds)
        scheduler.end_step(seconds)


def bind_time_budget(section: Any, budget_s: float) -> Any:
    """A recipe's ``lr_scheduler`` section with ``budget_s`` filled in when it is a :class:`RunLengthLR` over time
    without one (``rlpost bench`` binds its ``time_budget_s``); any other section is returned unchanged."""
    if not (isinstance(section, dict) and is_run_length_lr(section.get("class_path"))):
        return section
    args = section.get("init_args")
    if not isinstance(args, dict) or args.get("over") != "time" or args.get("budget_s") is not None:
        return section
    return {**section, "init_args": {**args, "budget_s": budget_s}}


def is_run_length_lr(class_path: Any) -> bool:
    """Whether a recipe's ``class_path`` names :class:`RunLengthLR` or a subclass (dotted path or class name)."""
    if not isinstance(class_path, str):
        return False
    if class_path in ("RunLengthLR", f"{__name__}.RunLengthLR"):
        return True
    module, _, name = class_path.rpartition(".")
    if not module:
        return False
    import importlib

    try:
        found = getattr(importlib.import_module(module), name, None)
    except ImportError:
        return False
    return isinstance(found, type) and issubclass(found, RunLengthLR)
