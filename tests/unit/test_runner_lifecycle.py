"""``Runner.begin()`` / ``step()`` / ``finish(status)`` (what ``run()`` is made of, and what ``rlpost bench`` drives)
and the runner's phase timer (``runner.phases``, rlpost/engine/phases.py)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from rlpost.apps.host import build_host
from rlpost.core.hookspecs import hookimpl
from rlpost.core.plugin_errors import PluginRuntimeError
from rlpost.engine.phases import STEP_PHASES, PhaseTimer
from rlpost.engine.recipe import validate
from rlpost.engine.runner import Runner
from tests import toy_components
from tests.toy_components import toy_recipe


class Recorder:
    """Lifecycle plugin recording the hooks a run calls, optionally failing in ``rlpost_after_run``."""

    def __init__(self, fail_after_run: bool = False) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fail_after_run = fail_after_run

    @hookimpl
    def rlpost_before_run(self, run: Any) -> None:
        self.calls.append(("before_run", run.step))

    @hookimpl
    def rlpost_after_step(self, run: Any, metrics: Any) -> None:
        self.calls.append(("after_step", run.step))

    @hookimpl
    def rlpost_after_run(self, run: Any, status: str) -> None:
        self.calls.append(("after_run", status))
        if self.fail_after_run:
            raise RuntimeError("flush failed")


def _runner(tmp_path: Any, name: str, plugin: Recorder, steps: int = 2) -> Runner:
    host = build_host(load_entrypoints=False, extra_plugins=(toy_components, plugin))
    return Runner(validate(toy_recipe(str(tmp_path / name), max_steps=steps), host), host)


def _untimed(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if not k.endswith("_sec") and not k.startswith("perf/peak")}


def test_begin_step_finish_is_run(tmp_path: Any) -> None:
    """Driving the pieces by hand gives run()'s metrics, hooks and summary."""
    whole, parts = Recorder(), Recorder()
    history = _runner(tmp_path, "whole", whole).run()
    runner = _runner(tmp_path, "parts", parts)
    runner.begin()
    manual = [runner.step() for _ in range(2)]
    runner.finish("completed")
    assert [_untimed(m) for m in manual] == [_untimed(m) for m in history]
    expected = [("before_run", 0), ("after_step", 1), ("after_step", 2), ("after_run", "completed")]
    assert parts.calls == whole.calls == expected
    summary = json.loads((tmp_path / "parts" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 2


def test_finish_reports_a_plugin_failure_by_status(tmp_path: Any) -> None:
    """A failing rlpost_after_run raises after a completed run and only warns when the run already failed."""
    runner = _runner(tmp_path, "failed", Recorder(fail_after_run=True))
    runner.begin()
    with pytest.warns(UserWarning, match=r"rlpost_after_run.*flush failed.*while the run was failed"):
        runner.finish("failed")
    assert json.loads((tmp_path / "failed" / "summary.json").read_text())["status"] == "failed"
    runner = _runner(tmp_path, "completed", Recorder(fail_after_run=True))
    runner.begin()
    with pytest.raises(PluginRuntimeError, match="flush failed"):
        runner.finish("completed")


def test_step_times_its_phases_and_reports_them(tmp_path: Any) -> None:
    runner = _runner(tmp_path, "run", Recorder())
    runner.begin()
    before = runner.phases.snapshot()
    metrics = runner.step()
    assert set(runner.phases.current) == set(STEP_PHASES)
    for phase in STEP_PHASES:
        assert metrics[f"perf/{phase}_sec"] == runner.phases.current[phase] >= 0.0
        assert runner.phases.totals[phase] - before.get(phase, 0.0) == pytest.approx(runner.phases.current[phase])
    assert metrics["perf/step_sec"] >= sum(runner.phases.current.values())
    runner.step()
    assert runner.phases.totals["update"] == pytest.approx(
        sum(m["perf/update_sec"] for m in runner.ctx.history), rel=1e-9
    )
    runner.finish("completed")


def test_phase_timer_accumulates_and_charges_a_raising_block() -> None:
    timer = PhaseTimer()
    with timer.timed("a"):
        time.sleep(0.01)
    with pytest.raises(ValueError), timer.timed("a"):
        time.sleep(0.01)
        raise ValueError("boom")
    assert timer.totals["a"] == pytest.approx(timer.current["a"]) and timer.totals["a"] >= 0.02
    timer.start_step()
    assert timer.current == {} and timer.totals["a"] >= 0.02
    with timer.timed("b"):
        pass
    assert set(timer.current) == {"b"} and set(timer.snapshot()) == {"a", "b"}
    assert timer.step_elapsed() >= 0.0
