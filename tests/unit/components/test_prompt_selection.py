"""Spread-guided prompt selection (``run.min_group_spread``): rule, stream integration, resume, validation."""

from __future__ import annotations

import math

import pytest
import torch

from rlpost.apps.host import build_host
from rlpost.components.prompt_selection import SpreadFilter, group_spreads
from rlpost.components.prompts import PromptStream
from rlpost.core.contract import RewardScores
from rlpost.core.plugins import PluginHost
from rlpost.engine.recipe import RecipeError, validate
from rlpost.engine.runner import Runner
from tests import toy_components
from tests.toy_components import toy_recipe


class _Groups:
    """The two fields of a rollout that :func:`group_spreads` reads."""

    def __init__(self, prompts: list[str], sample_group: list[int]) -> None:
        self.prompts = prompts
        self.sample_group = torch.tensor(sample_group)


def _scores(values: list[float], second: list[float] | None = None) -> RewardScores:
    scores = {"a": torch.tensor(values)}
    weights = {"a": 1.0}
    if second is not None:
        scores["b"], weights["b"] = torch.tensor(second), 0.5
    return RewardScores(scores, weights)


def test_group_spreads_is_the_population_std_of_the_weighted_sum_per_group():
    rollout = _Groups(["p", "q"], [0, 0, 1, 1, 1])
    spreads = group_spreads(rollout, _scores([0.0, 1.0, 0.2, 0.2, 0.2], [2.0, 0.0, 0.0, 0.0, 3.0]))  # type: ignore[arg-type]
    # group p: weighted sums 1.0, 1.0 -> 0; group q: 0.2, 0.2, 1.7 -> std ddof 0
    assert spreads["p"] == pytest.approx(0.0, abs=1e-7)
    assert spreads["q"] == pytest.approx(float(torch.tensor([0.2, 0.2, 1.7]).std(correction=0)), rel=1e-6)


def test_group_spreads_ignores_groups_with_non_finite_rewards():
    rollout = _Groups(["p", "q"], [0, 0, 1, 1])
    spreads = group_spreads(rollout, _scores([0.0, math.nan, 0.0, 1.0]))  # type: ignore[arg-type]
    assert "p" not in spreads and spreads["q"] == pytest.approx(0.5)


def test_filter_takes_unseen_and_spread_prompts_and_skips_flat_ones_at_most_max_skips_times():
    f = SpreadFilter(min_spread=0.1, max_skips=2)
    assert f.admit("new")  # never seen: explore
    f.spread.update({"flat": 0.01, "wide": 0.3, "edge": 0.1})
    assert f.admit("wide") and f.admit("edge")  # the threshold itself is taken
    assert [f.admit("flat") for _ in range(7)] == [False, False, True, False, False, True, False]
    assert f.skipped_last_batch == 5


def test_filter_rejects_bad_settings():
    with pytest.raises(ValueError, match="min_spread"):
        SpreadFilter(min_spread=0.0)
    with pytest.raises(ValueError, match="min_spread"):
        SpreadFilter(min_spread=math.nan)
    with pytest.raises(ValueError, match="max_skips"):
        SpreadFilter(min_spread=0.1, max_skips=0)


def _items(n: int) -> list[tuple[str, dict]]:
    return [(f"p{i}", {"i": i}) for i in range(n)]


def test_stream_without_observations_or_selector_is_the_plain_stream():
    plain = PromptStream(_items(5), seed=3)
    fresh = PromptStream(_items(5), seed=3, selector=SpreadFilter(0.1))
    for _ in range(6):
        assert plain.next_batch(2, 4).prompts == fresh.next_batch(2, 4).prompts


def test_stream_fills_the_batch_past_skipped_prompts_and_keeps_the_batch_size():
    f = SpreadFilter(0.1, max_skips=1)
    stream = PromptStream(_items(6), seed=0, shuffle=False, selector=f)
    f.spread.update({"p1": 0.0, "p2": 0.0, "p4": 0.5})
    batch = stream.next_batch(3, 2)
    assert batch.prompts == ["p0", "p3", "p4"] and batch.metadata == [{"i": 0}, {"i": 3}, {"i": 4}]
    assert batch.samples_per_group == 2
    assert stream.metrics() == {"prompts/skipped": 2.0, "prompts/low_spread_frac": pytest.approx(2 / 3)}
    # p1 and p2 were consumed in epoch 0; in epoch 1 they have been skipped once (max_skips) and are taken again
    assert stream.next_batch(3, 2).prompts == ["p5", "p0", "p1"]
    assert stream.metrics()["prompts/skipped"] == 0.0


def test_stream_state_round_trips_the_selector_and_reads_old_checkpoints():
    f = SpreadFilter(0.1)
    stream = PromptStream(_items(4), seed=1, selector=f)
    f.spread.update({"p1": 0.0, "p2": 0.7})
    stream.next_batch(3, 1)
    state = stream.state_dict()
    other = PromptStream(_items(4), seed=1, selector=SpreadFilter(0.1))
    other.load_state_dict(state)
    assert other.state_dict() == state
    assert [stream.next_batch(2, 1).prompts for _ in range(3)] == [other.next_batch(2, 1).prompts for _ in range(3)]
    legacy = PromptStream(_items(4), seed=1, selector=SpreadFilter(0.1))
    legacy.load_state_dict({"epoch": 0, "position": 3})  # a checkpoint written without selection
    assert legacy.selector is not None and legacy.selector.spread == {}


@pytest.fixture
def host() -> PluginHost:
    return build_host(load_entrypoints=False, extra_plugins=(toy_components,))


def test_recipe_rejects_bad_selection_settings(tmp_path, host):
    with pytest.raises(RecipeError, match=r"run\.min_group_spread"):
        validate(toy_recipe(str(tmp_path / "a"), min_group_spread=-0.1), host)
    with pytest.raises(RecipeError, match=r"run\.max_skips"):
        validate(toy_recipe(str(tmp_path / "b"), min_group_spread=0.1, max_skips=0), host)


def _run(out, host, steps: int, resume: str | None = None) -> Runner:
    cfg = toy_recipe(str(out), max_steps=steps, min_group_spread=1.0)
    cfg["checkpoint"] = {"every": 1, "keep_last": 2}
    runner = Runner(validate(cfg, host), host, resume=resume)
    runner.run()
    return runner


def test_runner_skips_flat_prompts_at_equal_batch_size_and_resumes_exactly(tmp_path, host):
    # The toy reward's groups spread far less than 1.0, so once seen every prompt is skipped max_skips times in a row.
    full = _run(tmp_path / "full", host, 6)
    skipped = [m["prompts/skipped"] for m in full.ctx.history]
    assert skipped[0] == 0.0 and sum(skipped) > 0
    assert all(m["perf/images"] == 8.0 for m in full.ctx.history)  # 2 groups x 4 samples every step
    assert full.stream is not None and full.stream.selector is not None
    assert set(full.stream.selector.spread) == {"a cat", "a dog", "a fish"}
    _run(tmp_path / "part", host, 3)
    resumed = _run(tmp_path / "part", host, 6, resume="latest")
    assert resumed.stream is not None and resumed.stream.state_dict() == full.stream.state_dict()

    def strip(history):
        return [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in history]

    assert strip(resumed.ctx.history) == strip(full.ctx.history)
