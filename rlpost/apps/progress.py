"""Rich progress bar and end-of-run summary table, as a lifecycle plugin registered on the main process only.

Only this module and ``rlpost.apps.cli`` import rich: the runner stays free of UI code.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from rlpost.core.context import RunContext
from rlpost.core.hookspecs import hookimpl
from rlpost.engine.evaluation import LAST_EVAL

__all__ = ["RichProgress", "alarm_text"]

# Metrics shown next to the bar and in the summary table, when present.
SHOWN = ("reward/weighted", "loss/policy", "train/clipfrac", "kl/approx", "perf/step_sec")


def alarm_text(eval_metrics: Mapping[str, float]) -> str:
    """``"HACKING ALARM (step N)"`` once the reward-hacking alarm (:mod:`rlpost.engine.evaluation.alarm`) has
    fired, else ``""``."""
    if not eval_metrics.get("alarm/fired"):
        return ""
    step = eval_metrics.get("alarm/fired_step")
    return "HACKING ALARM" + (f" (step {int(step)})" if step is not None else "")


class RichProgress:
    """Progress bar fed by ``rlpost_after_step`` and a summary table at ``rlpost_after_run``.

    Args:
        console: Where to draw (stderr by default).
    """

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.progress: Progress | None = None
        self.task: Any = None

    @hookimpl
    def rlpost_before_run(self, run: RunContext) -> None:
        """Start the bar."""
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            console=self.console,
            disable=not run.is_main_process,
        )
        self.progress.start()
        self.task = self.progress.add_task("train", total=run.recipe.run.max_steps, info="")

    @hookimpl
    def rlpost_after_step(self, run: RunContext, metrics: Mapping[str, float]) -> None:
        """Advance the bar and show the headline metrics."""
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
