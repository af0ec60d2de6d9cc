"""Progress a person can read at 80 columns: the bar keeps step ``n/N``, elapsed time and ETA whatever the metrics
say; loading the model, evaluations and checkpoints (and the bench's phases) show as phases with a line each."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml
from rich.console import Console

from rlpost.apps import cli
from rlpost.apps.host import build_host
from rlpost.apps.progress import PhaseDisplay, RichProgress
from rlpost.core.context import RunContext
from rlpost.engine.phases import PhaseTimer
from tests import toy_components
from tests.toy_components import toy_recipe

LONG_METRICS = {
    "reward/weighted": 0.812345678,
    "loss/policy": -0.0123456789,
    "train/clipfrac": 0.123456,
    "kl/approx": 0.000123456,
    "perf/step_sec": 1.2345678,
}


class Clock:
    """A clock the test advances (rich's elapsed time and speed estimate read it)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _context(max_steps: int, tmp_path: Path) -> RunContext:
    recipe: Any = SimpleNamespace(run=SimpleNamespace(max_steps=max_steps))
    return RunContext(recipe=recipe, output_dir=tmp_path)


def _lines(renderable: Any, width: int = 80) -> list[str]:
    console = Console(width=width, file=io.StringIO(), record=True, force_terminal=False, color_system=None)
    console.print(renderable)
    return console.export_text().splitlines()


def test_the_bar_keeps_step_elapsed_and_eta_at_80_columns(tmp_path):
    clock, out = Clock(), io.StringIO()
    progress = RichProgress(Console(width=80, file=out, force_terminal=False), get_time=clock)
    ctx = _context(100, tmp_path)
    progress.rlpost_before_run(ctx)
    for step in range(1, 13):  # 12 steps of 1.5 s each
        clock.now += 1.5
        ctx.step = step
        progress.rlpost_after_step(ctx, LONG_METRICS)
    assert progress.progress is not None
    bar, metrics = _lines(progress.progress.get_renderable())
    assert all(len(line) <= 80 for line in (bar, metrics))
    # 12 of 100 steps; 18 s elapsed; 88 steps left at 1.5 s each: 132 s.
    assert "12/100" in bar and "0:00:18" in bar and "ETA 0:02:12" in bar, bar
    assert bar.startswith("train") and "━" in bar
    # The metrics have a line of their own, cut at the width.
    assert metrics.strip().startswith("weighted=0.8123  policy=-0.01235") and metrics.endswith("…")
    # At 60 columns too the step count, elapsed time and ETA stay (the bar itself shrinks).
    narrow = _lines(progress.progress.get_renderable(), width=60)[0]
    assert "12/100" in narrow and "0:00:18" in narrow and "ETA 0:02:12" in narrow, narrow
    # A phase between steps names the bar while it runs, then prints its line.
    progress.phase_started("eval")
    assert _lines(progress.progress.get_renderable())[0].startswith("eval ")
    clock.now += 4.0
    progress.phase_ended("eval", 4.04)
    assert _lines(progress.progress.get_renderable())[0].startswith("train ")
    progress.phase_started("checkpoint")
    progress.phase_ended("checkpoint", 0.31)
    progress.rlpost_after_run(ctx, "completed")
    text = out.getvalue()
    assert "evaluated at step 12 in 4.0 s" in text and "checkpoint saved at step 12 in 0.3 s" in text


def test_model_loading_shows_as_a_phase_before_the_bar(tmp_path):
    out = io.StringIO()
    progress = RichProgress(Console(width=80, file=out, force_terminal=False))
    timer = PhaseTimer()
    timer.listeners.append(progress)
    with timer.timed("load"):
        assert progress.phases._status is not None  # the spinner runs while the model loads
    assert progress.phases._status is None
    assert out.getvalue().startswith("model and rewards loaded in ")


def test_a_training_run_prints_its_phases_and_a_readable_bar(tmp_path, monkeypatch, capsys):
    host = build_host(load_entrypoints=False, extra_plugins=(toy_components,))
    monkeypatch.setattr(cli, "get_host", lambda: host)
    cfg = toy_recipe(str(tmp_path / "run"), max_steps=2, progress=True)
    cfg["eval"] = {"prompts": {"class_path": "prompt-list", "init_args": {"prompts": ["a cat"]}}, "every": 1}
    cfg["checkpoint"] = {"every": 1}
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(cfg))
    assert cli.main(["train", "--recipe", str(recipe)]) == 0
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert any(line.startswith("model and rewards loaded in ") for line in lines), err
    for step in (0, 1, 2):
        assert any(line.startswith(f"evaluated at step {step} in ") for line in lines), (step, err)
    for step in (1, 2):
        assert any(line.startswith(f"checkpoint saved at step {step} in ") for line in lines), (step, err)
    bar = next(line for line in lines if "2/2" in line)
    assert bar.startswith("train") and "ETA" in bar and len(bar) <= 80, bar


def test_a_phase_that_fails_prints_no_line_and_stops_its_spinner(tmp_path):
    out = io.StringIO()
    progress = RichProgress(Console(width=80, file=out, force_terminal=False))
    timer = PhaseTimer()
    timer.listeners.append(progress)
    try:
        with timer.timed("load"):
            raise OSError("weights unreadable")
    except OSError:
        pass
    assert progress.phases._status is None and out.getvalue() == ""


def test_the_bench_phases_show_as_phases():
    out = io.StringIO()
    timer = PhaseTimer()
    timer.listeners.append(PhaseDisplay(Console(width=80, file=out, force_terminal=False), prefix="[bench] "))
    with timer.timed("set-up"):
        pass
    with timer.timed("training"):
        with timer.timed("rollout"):  # a step's phase: the bar's business, no line
            pass
        with timer.timed("eval"):
            pass
    lines = out.getvalue().splitlines()
    assert [line.split(" in ")[0] for line in lines] == [
        "[bench] every run set up",
        "[bench] evaluated",
        "[bench] training done",
    ]


def test_rlpost_bench_shows_its_phases(tmp_path, monkeypatch, capsys):
    """``rlpost bench`` attaches a phase display to the bench's own timer (the bench's work itself stubbed out)."""
    import rlpost.bench as bench_cli
    from rlpost.bench import driver

    spec: Any = SimpleNamespace(output_dir=str(tmp_path / "bench"), calibration_batch_sizes=[1], calibration_repeats=1)
    monkeypatch.setattr(bench_cli, "load_bench", lambda recipe, overrides: spec)
    monkeypatch.setattr(driver.Bench, "build", lambda self: self.algos.append(SimpleNamespace(recipe=None)))
    monkeypatch.setattr(driver, "calibrate", lambda recipe, sizes, repeats: "calibrated")
    monkeypatch.setattr(driver.Bench, "_schedule", lambda self: None)
    monkeypatch.setattr(driver.Bench, "_close", lambda self, status: None)
    monkeypatch.setattr(driver.Bench, "result", lambda self: {})
    monkeypatch.setattr(driver, "write_outputs", lambda result, out: None)
    monkeypatch.setattr(bench_cli, "markdown", lambda result: "")
    assert cli.main(["bench", "--recipe", str(tmp_path / "b.yaml")]) == 0
    lines = [line.split(" in ")[0] for line in capsys.readouterr().err.splitlines() if " in " in line]
    assert lines[:4] == [
        "[bench] every run set up",
        "[bench] cost model calibrated",
        "[bench] training done",
        "[bench] report written",
    ], lines
