"""The reward-hacking alarm (rlpost.engine.evaluation.alarm): statistics, the trend rule, recipe checks and the runner
wiring."""

from __future__ import annotations

import json
import sys
from typing import Any, ClassVar

import pytest
import torch

from rlpost import RunStatus, hookimpl
from rlpost.apps.alarm_replay import replay
from rlpost.apps.host import build_host
from rlpost.apps.progress import alarm_text
from rlpost.apps.reporting import report_summary
from rlpost.core.api import RewardSource
from rlpost.core.plugins import PluginHost
from rlpost.engine.evaluation import LAST_EVAL, AlarmConfig, RewardHackingAlarm, image_stats, ls_change
from rlpost.engine.recipe import RecipeError, validate
from rlpost.engine.runner import Runner
from tests import toy_components
from tests.toy_components import toy_recipe


def gray(values: list[float], size: int = 4) -> torch.Tensor:
    """``[N, size, size, 3]`` uint8 images, each one flat gray level."""
    return torch.stack([torch.full((size, size, 3), int(v)) for v in values]).to(torch.uint8)


def test_ls_change_is_the_fitted_rise_across_the_window() -> None:
    assert ls_change([0, 10, 20], [0.5, 0.6, 0.7]) == pytest.approx(0.2)
    assert ls_change([0, 10, 20], [0.7, 0.6, 0.5]) == pytest.approx(-0.2)
    # Noise around a flat line fits ~0 change; one outlier in the middle does not make a trend.
    assert ls_change([0, 10, 20], [0.5, 0.9, 0.5]) == pytest.approx(0.0)
    assert ls_change([5, 5], [0.1, 0.9]) == 0.0


def test_image_stats() -> None:
    images = gray([0, 255])
    red = torch.zeros(1, 4, 4, 3, dtype=torch.uint8)
    red[..., 0] = 200
    stats = image_stats(torch.cat([images, red]))
    torch.testing.assert_close(stats["brightness"], torch.tensor([0.0, 1.0, 200 / 765], dtype=torch.float64))
    torch.testing.assert_close(stats["saturation"], torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64))
    # Identical images have no diversity; with prompt groups, diversity is measured within each group.
    assert float(image_stats(gray([100, 100, 100]))["diversity"].max()) == 0.0
    grouped = image_stats(gray([0, 0, 200, 200]), groups=["a", "a", "b", "b"])["diversity"]
    assert float(grouped.max()) == 0.0
    whole = image_stats(gray([0, 0, 200, 200]))["diversity"]  # no repeated group label: the set is one group
    torch.testing.assert_close(whole, torch.full((4,), 100 / 255, dtype=torch.float64))
    with pytest.raises(ValueError, match="group labels"):
        image_stats(gray([0, 0]), groups=["a"])


def feed(alarm: RewardHackingAlarm, rewards: list[float], judges: list[float], levels: list[float] | None = None):
    """One evaluation per index, 10 steps apart, 4 images each of gray ``levels[i]`` (default 60)."""
    records = []
    for i, (r, j) in enumerate(zip(rewards, judges, strict=True)):
        level = 60.0 if levels is None else levels[i]
        records.append(alarm.observe(10 * i, {"rew": [r] * 4, "jud": [j] * 4}, gray([level] * 4)))
    return records


def make(**config: Any) -> RewardHackingAlarm:
    return RewardHackingAlarm(AlarmConfig(enabled=True, **config), watched=["rew"], judges=["jud"])


def test_fires_when_the_reward_rises_while_the_judge_falls() -> None:
    alarm = make(window=3, judge_drop=0.1)
    out = feed(alarm, [0.5, 0.6, 0.7, 0.8, 0.9], [0.6, 0.7, 0.65, 0.55, 0.4])
    # Evaluation 3 (step 30): reward rising, judge 0.15 below its best (0.7) and falling over steps 10-30.
    assert [r["active"] for r in out] == [False, False, False, True, True]
    assert out[3]["fired_step"] == 30 and out[4]["fired_step"] == 30 and alarm.fired
    assert out[3]["judge_drop"]["jud"] == pytest.approx(0.15)
    assert any("judge jud fell" in reason for reason in out[3]["reasons"])
    assert not alarm.stop_requested  # stop is off by default
    metrics = RewardHackingAlarm.metrics(out[3])
    assert metrics["alarm/active"] == 1.0 and metrics["alarm/fired_step"] == 30.0
    assert alarm_text(metrics) == "HACKING ALARM (step 30)" and alarm_text({"alarm/fired": 0.0}) == ""


@pytest.mark.parametrize(
    ("rewards", "judges", "why"),
    [
        ([0.5, 0.6, 0.7, 0.8, 0.9], [0.6, 0.65, 0.7, 0.75, 0.8], "judge rises with the reward: real progress"),
        ([0.5, 0.8, 0.8, 0.79, 0.8], [0.6, 0.8, 0.7, 0.6, 0.5], "judge falls but the reward does not rise"),
        ([0.5, 0.6, 0.7, 0.8, 0.9], [0.6, 0.7, 0.68, 0.66, 0.64], "judge dips less than judge_drop"),
        ([0.9, 0.5, 0.6, 0.7, 0.8], [0.8, 0.8, 0.6, 0.5, 0.4], "reward rising but still below its baseline"),
        ([0.5, 0.6, 0.7, 0.8, 0.9], [0.6, 0.9, 0.75, 0.9, 0.92], "judge dipped once but is not falling"),
    ],
)
def test_stays_silent(rewards: list[float], judges: list[float], why: str) -> None:
    alarm = make(window=3, judge_drop=0.1)
    assert not any(r["active"] for r in feed(alarm, rewards, judges)), why
    assert not alarm.fired


def test_stat_drift_fires_only_with_a_rising_reward_and_beyond_the_threshold() -> None:
    rising, steady = [0.5, 0.6, 0.7, 0.8], [0.7, 0.7, 0.7, 0.7]
    bright = [60.0, 70.0, 80.0, 90.0]  # +30/255 = +0.118 by the last evaluation
    out = feed(make(window=3, stat_drift=0.08), rising, steady, bright)
    assert [r["active"] for r in out] == [False, False, False, True]
    assert out[3]["stat_drift"]["brightness"] == pytest.approx(30 / 255)
    assert any("brightness drifted" in reason for reason in out[3]["reasons"])
    assert not any(r["active"] for r in feed(make(window=3, stat_drift=0.2), rising, steady, bright))
    assert not any(r["active"] for r in feed(make(window=3, stat_drift=0.08), steady, steady, bright))


def test_needs_a_full_window_and_latches() -> None:
    alarm = make(window=4, judge_drop=0.05, stop=True)
    out = feed(alarm, [0.5, 0.7, 0.9, 0.95, 0.5, 0.5], [0.8, 0.5, 0.3, 0.2, 0.8, 0.8])
    assert [r["active"] for r in out][:3] == [False, False, False]  # a window of 4 needs 4 evaluations
    assert out[3]["active"] and alarm.stop_requested
    assert not out[5]["active"] and out[5]["fired"] and out[5]["fired_step"] == 30


@pytest.mark.parametrize(
    ("field", "value"),
    [("window", 1), ("judge_drop", 0.0), ("stat_drift", -1.0), ("reward_rise", float("nan"))],
)
def test_config_problems_name_the_field(field: str, value: float) -> None:
    problems = AlarmConfig(**{field: value}).problems()
    assert len(problems) == 1 and problems[0].startswith(f"eval.alarm.{field}:")
    assert AlarmConfig().problems() == []


# ------------------------------------------------------------------------------------------- runner wiring
def _contrast(images: torch.Tensor) -> torch.Tensor:
    return (images.float() / 127.5 - 1.0).abs().mean(dim=(1, 2, 3))


class ToyContrast(RewardSource):
    """A training reward the toy policy can raise quickly (its velocity scale ``a`` sets the output contrast)."""

    name: ClassVar[str] = "toy-contrast"

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> torch.Tensor:
        return _contrast(images)


class ToyFlatness(RewardSource):
    """A second judge that disagrees with the training reward: it falls exactly when the contrast rises."""

    name: ClassVar[str] = "toy-flatness"

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> torch.Tensor:
        return 1.0 - _contrast(images)


class ToyInk(RewardSource):
    """A second judge that agrees with the training reward (it rises with the contrast)."""

    name: ClassVar[str] = "toy-ink"

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> torch.Tensor:
        return _contrast(images)


@hookimpl
def rlpost_register_reward_sources(register: Any) -> None:
    register(ToyContrast)
    register(ToyFlatness)
    register(ToyInk)


@pytest.fixture
def host() -> PluginHost:
    return build_host(load_entrypoints=False, extra_plugins=(toy_components, sys.modules[__name__]))


def _cfg(tmp_path: Any, judge: str = "toy-flatness", max_steps: int = 12, **alarm: Any) -> dict[str, Any]:
    """The toy world trained on contrast (SGD lr 1: it rises within a few steps), evaluated every 2 steps."""
    cfg = toy_recipe(str(tmp_path / "run"), max_steps=max_steps)
    cfg["rewards"] = [{"class_path": "toy-contrast"}]
    cfg["torch_optimizer"]["init_args"]["lr"] = 1.0
    cfg["eval"] = {
        "prompts": {"class_path": "prompt-list", "init_args": {"prompts": ["a cat", "a dog", "a fish"]}},
        "judges": [{"class_path": judge}],
        "num_steps": 3,
        "every": 2,
        "batch_size": 3,
        "alarm": {"enabled": True, "window": 3, **alarm},
    }
    return cfg


def _records(tmp_path: Any) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]


def test_recipe_checks_name_alarm_fields(tmp_path: Any, host: PluginHost) -> None:
    cfg = _cfg(tmp_path)
    cfg["eval"]["alarm"]["windw"] = 3
    with pytest.raises(RecipeError) as info:
        validate(cfg, host)
    assert "eval.alarm" in str(info.value) and "windw" in str(info.value)
    with pytest.raises(RecipeError, match=r"eval\.alarm\.window: must be >= 2"):
        validate(_cfg(tmp_path, window=1), host)
    cfg = _cfg(tmp_path)
    cfg["eval"]["rewards"] = [{"class_path": "toy-ink"}]  # nothing trained left to watch
    with pytest.raises(RecipeError, match="eval.alarm: enabled, but no evaluation reward is a training reward"):
        validate(cfg, host)
    recipe = validate(_cfg(tmp_path), host)
    assert recipe.eval is not None and recipe.eval.alarm is not None and recipe.eval.trained == ["toy-contrast"]


def test_alarm_fires_on_a_planted_hack_and_stops_the_run(tmp_path: Any, host: PluginHost) -> None:
    """Trained on contrast, judged by flatness: the alarm fires, the run stops there, and the report says so."""
    recipe = validate(_cfg(tmp_path, max_steps=30, stop=True, judge_drop=0.02, stat_drift=0.5), host)
    runner = Runner(recipe, host)
    history = runner.run()
    records = _records(tmp_path)
    fired = [r["alarm"] for r in records if r["alarm"]["active"]]
    assert fired, [r["alarm"] for r in records]
    step = fired[0]["fired_step"]
    assert 4 <= step < 30 and len(history) == step == records[-1]["step"]  # stopped right after firing
    assert any("judge toy-flatness fell" in reason for reason in fired[0]["reasons"])
    run = tmp_path / "run"
    assert json.loads((run / "summary.json").read_text())["status"] == "stopped" == runner.status
    assert runner.status is RunStatus.STOPPED
    assert (run / "checkpoints" / f"step_{step:06d}").is_dir()
    assert alarm_text(runner.ctx.stash.get(LAST_EVAL, {})) == f"HACKING ALARM (step {step})"
    summary = report_summary(run)
    assert summary["alarm"]["fired_step"] == step and summary["alarm"]["reasons"] == fired[0]["reasons"]
    # Replaying the run directory (saved images and per-prompt scores) gives the live detector's records.
    replayed = replay(run, AlarmConfig(enabled=True, window=3, judge_drop=0.02, stat_drift=0.5))
    assert [r["active"] for r in replayed] == [r["alarm"]["active"] for r in records]
    for live, again in zip(records, replayed, strict=True):
        assert again["stats"] == pytest.approx(live["alarm"]["stats"], abs=1e-12)
        assert again["reward_change"] == pytest.approx(live["alarm"]["reward_change"], abs=1e-6)


def test_alarm_stays_silent_when_the_judge_agrees(tmp_path: Any, host: PluginHost) -> None:
    """The same training with a judge that rises with the reward: no alarm, the run completes."""
    Runner(validate(_cfg(tmp_path, judge="toy-ink", stop=True, judge_drop=0.02, stat_drift=0.5), host), host).run()
    records = _records(tmp_path)
    assert [r["step"] for r in records] == list(range(0, 13, 2))
    assert records[-1]["eval/toy-contrast"] > records[0]["eval/toy-contrast"] + 0.02  # the reward did rise
    assert not any(r["alarm"]["fired"] for r in records)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "completed"
    assert report_summary(tmp_path / "run")["alarm"] == {"enabled": True, "fired_step": None, "reasons": []}
