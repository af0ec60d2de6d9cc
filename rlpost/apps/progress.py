"""What a person sees of a run: a progress bar (step ``n/N``, elapsed, ETA, the headline metrics on a line of their
own), the phases around it (loading the model, evaluations, checkpoints; the bench's set-up, calibration, training
and report) as a spinner while they run and a line when they end, and the end-of-run summary table.

:class:`RichProgress` is a lifecycle plugin registered on the main process only, and a
:class:`~rlpost.engine.phases.PhaseListener` of the runner's ``runner.phases``; :class:`PhaseDisplay` shows the phases
of anything with a :class:`~rlpost.engine.phases.PhaseTimer` (``rlpost bench``). Only this module and
``rlpost.apps.cli`` import rich (``rlpost bench`` uses :class:`PhaseDisplay`): the runner stays free of UI code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rich.console import Console, RenderableType
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.status import Status
from rich.table import Column, Table
from rich.text import Text

from rlpost.core.context import RunContext
from rlpost.core.hookspecs import hookimpl
from rlpost.engine.evaluation import LAST_EVAL
from rlpost.engine.phases import STEP_PHASES

__all__ = ["PHASE_LABELS", "PhaseDisplay", "RichProgress", "alarm_text"]

# Metrics shown under the bar and in the summary table, when present.
SHOWN = ("reward/weighted", "loss/policy", "train/clipfrac", "kl/approx", "perf/step_sec")

PHASE_LABELS = {
    "load": ("loading the model and rewards", "model and rewards loaded"),
    "eval": ("evaluating", "evaluated"),
    "checkpoint": ("saving a checkpoint", "checkpoint saved"),
    "set-up": ("setting up every run (models, rewards)", "every run set up"),
    "calibration": ("calibrating the cost model", "cost model calibrated"),
    "training": ("training", "training done"),
    "report": ("writing the report", "report written"),
}
"""Phase name -> (what the spinner says while it runs, what the line says when it ended). Another phase shows its
name."""


def alarm_text(eval_metrics: Mapping[str, float]) -> str:
    """``"HACKING ALARM (step N)"`` once the reward-hacking alarm (:mod:`rlpost.engine.evaluation.alarm`) has
    fired, else ``""``."""
    if not eval_metrics.get("alarm/fired"):
        return ""
    step = eval_metrics.get("alarm/fired_step")
    return "HACKING ALARM" + (f" (step {int(step)})" if step is not None else "")


def _seconds(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{int(seconds // 60)} min {seconds % 60:.0f} s"


class PhaseDisplay:
    """A spinner naming the phase that runs and a line when it ends (``model and rewards loaded in 12.3 s``); phases
    of a training step (:data:`~rlpost.engine.phases.STEP_PHASES`) are left to the progress bar. Nested phases (an
    evaluation within the bench's training) show the innermost; the outer one's spinner comes back after it.

    Args:
        console: Where to draw (stderr by default).
        prefix: Put before every line (``"[bench] "``), e.g. to match a command's other lines.
    """

    def __init__(self, console: Console | None = None, prefix: str = "") -> None:
        self.console = console or Console(stderr=True)
        self.prefix = prefix
        self.where = ""
        """Said after the phase in its line (``" at step 10"``): the caller keeps it current."""
        self._stack: list[str] = []
        self._status: Status | None = None

    def phase_started(self, phase: str) -> None:
        """Show ``phase``'s spinner (:class:`~rlpost.engine.phases.PhaseListener`)."""
        if phase in STEP_PHASES:
            return
        self._stack.append(phase)
        self._show(PHASE_LABELS.get(phase, (phase, phase))[0])

    def phase_ended(self, phase: str, seconds: float, ok: bool = True) -> None:
        """Print the phase's line (unless it failed: the error says what happened) and show the enclosing phase
        again, if any."""
        if phase in STEP_PHASES or phase not in self._stack:
            return
        del self._stack[len(self._stack) - 1 - self._stack[::-1].index(phase)]
        self._show(PHASE_LABELS.get(self._stack[-1], (self._stack[-1],))[0] if self._stack else None)
        if ok:
            self.report(phase, seconds)

    def report(self, phase: str, seconds: float) -> None:
        """The line saying ``phase`` ended (``model and rewards loaded in 12.3 s``, ``evaluated at step 10 in 4 s``)."""
        done = PHASE_LABELS.get(phase, (phase, f"{phase} done"))[1]
        self.console.print(f"{self.prefix}{done}{self.where} in {_seconds(seconds)}", highlight=False, markup=False)

    def _show(self, label: str | None) -> None:
        if label is None:
            if self._status is not None:
                self._status.stop()
                self._status = None
        elif self._status is None:
            self._status = self.console.status(Text(f"{self.prefix}{label} ..."))
            self._status.start()
        else:
            self._status.update(Text(f"{self.prefix}{label} ..."))

    def close(self) -> None:
        """Stop the spinner (e.g. after a failure inside a phase)."""
        self._stack.clear()
        self._show(None)


class _BarAndMetrics(Progress):
    """The bar's row, then each task's ``info`` (the headline metrics) on a line of its own, cut with an ellipsis
    at the console's width: the metrics never take the step count, elapsed time or ETA away."""

    def get_renderables(self) -> Iterable[RenderableType]:
        yield self.make_tasks_table(self.tasks)
        for task in self.tasks:
            info = str(task.fields.get("info", ""))
            if info:
                line = Text.from_markup(f"  {info}", overflow="ellipsis")
                line.no_wrap = True
                yield line


class RichProgress:
    """Progress bar fed by ``rlpost_after_step``, the run's phases (attach it to ``runner.phases.listeners``) and a
    summary table at ``rlpost_after_run``.

    The bar's row is ``<phase> <bar> n/N <elapsed> ETA <remaining>``; its bar shrinks first, so step, elapsed time
    and ETA fit 80 columns. ``<phase>`` is ``train`` or the step's phase (``rollout``, ``reward``, ...). Loading
    the model, each evaluation and each checkpoint show a spinner while they run and a line when they end
    (:class:`PhaseDisplay`).

    Args:
        console: Where to draw (stderr by default).
        get_time: The clock of the bar's elapsed time and ETA (``time.monotonic`` by default; tests pass their own).
    """

    def __init__(self, console: Console | None = None, get_time: Callable[[], float] | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.get_time = get_time
        self.progress: Progress | None = None
        self.task: Any = None
        self.phases = PhaseDisplay(self.console)

    def _bar(self) -> Progress | None:
        """The bar while it is shown."""
        return self.progress if self.progress is not None and self.progress.live.is_started else None

    def phase_started(self, phase: str) -> None:
        """While the bar is shown, every phase names it (``rollout``, ``eval``, ``checkpoint``); before it (loading
        the model) a spinner names the phase (:class:`PhaseDisplay`)."""
        bar = self._bar()
        if bar is not None:
            bar.update(self.task, phase=phase)
        else:
            self.phases.phase_started(phase)

    def phase_ended(self, phase: str, seconds: float, ok: bool = True) -> None:
        """The bar reads ``train`` again; a phase that is not a step's prints its line (unless it failed)."""
        bar = self._bar()
        if bar is not None:
            bar.update(self.task, phase="train")
            if phase not in STEP_PHASES and ok:
                self.phases.report(phase, seconds)
        else:
            self.phases.phase_ended(phase, seconds, ok)

    @hookimpl
    def rlpost_before_run(self, run: RunContext) -> None:
        """Start the bar (at the resumed step for a resumed run)."""
        self.phases.close()  # a spinner left by a phase that did not end
        self.phases.where = f" at step {run.step}"
        clock: dict[str, Any] = {"get_time": self.get_time} if self.get_time is not None else {}
        self.progress = _BarAndMetrics(
            TextColumn("[bold]{task.fields[phase]}", table_column=Column(no_wrap=True, width=10)),
            BarColumn(bar_width=None, table_column=Column(ratio=1)),
            MofNCompleteColumn(table_column=Column(no_wrap=True)),
            TimeElapsedColumn(table_column=Column(no_wrap=True)),
            TextColumn("ETA", table_column=Column(no_wrap=True)),
            TimeRemainingColumn(table_column=Column(no_wrap=True)),
            console=self.console,
            disable=not run.is_main_process,
            expand=True,
            **clock,
        )
        self.progress.start()
        self.task = self.progress.add_task(
            "train", total=run.recipe.run.max_steps, completed=run.step, phase="train", info=""
        )

    @hookimpl
    def rlpost_after_step(self, run: RunContext, metrics: Mapping[str, float]) -> None:
        """Advance the bar and show the headline metrics."""
        self.phases.where = f" at step {run.step}"
        if self.progress is not None:
            info = "  ".join(f"{k.split('/')[-1]}={metrics[k]:.4g}" for k in SHOWN if k in metrics)
            last: dict[str, float] = run.stash.get(LAST_EVAL, {})
            alarm = alarm_text(last)
            if alarm:
                info = f"[bold red]{alarm}[/]  {info}"
            self.progress.update(self.task, completed=run.step, info=info)

    @hookimpl
    def rlpost_after_run(self, run: RunContext, status: str) -> None:
        """Stop the bar and print the summary table."""
        self.phases.close()
        if self.progress is not None:
            self.progress.stop()
        if not run.is_main_process or not run.history:
            return
        last: dict[str, float] = run.stash.get(LAST_EVAL, {})
        alarm = alarm_text(last)
        if alarm:
            self.console.print(f'[bold red]{alarm}[/]: see eval.jsonl ("alarm") and report/summary.json')
        table = Table(title=f"rlpost run {status}: {run.step} steps -> {run.output_dir}")
        table.add_column("metric")
        table.add_column("first", justify="right")
        table.add_column("last", justify="right")
        first, last = run.history[0], run.history[-1]
        for key in sorted(last):
            if key.startswith(("reward/", "loss/", "train/clipfrac", "kl/", "perf/step_sec", "adv/")):
                table.add_row(key, f"{first.get(key, float('nan')):.5g}", f"{last[key]:.5g}")
        self.console.print(table)
