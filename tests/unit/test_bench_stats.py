"""``rlpost.bench.stats``: bootstrap intervals over seeds, ratios, and the separated / not separated rule."""

from __future__ import annotations

import math

import pytest

from rlpost.bench import stats as bs


def test_summarize_three_seeds_known_interval() -> None:
    # Resampling 3 seeds gives 27 equally likely means; the extremes (all 1s, all 3s) have 1/27 = 3.7 % each, more
    # than the 2.5 % tails, so the 95 % percentile interval is exactly the extremes.
    s = bs.summarize([1.0, 2.0, 3.0])
    assert s["n"] == 3 and s["mean"] == pytest.approx(2.0)
    assert (s["min"], s["max"]) == (1.0, 3.0)
    assert (s["lo"], s["hi"]) == (1.0, 3.0)
    # A 50 % interval is strictly inside.
    half = bs.summarize([1.0, 2.0, 3.0], confidence=0.5)
    assert 1.0 < half["lo"] < 2.0 < half["hi"] < 3.0


def test_summarize_is_reproducible_and_seed_dependent() -> None:
    values = [0.81, 0.77, 0.92, 0.85, 0.88]
    a, b = bs.summarize(values, seed=3), bs.summarize(values, seed=3)
    assert a == b
    c = bs.summarize(values, seed=4)
    assert (a["lo"], a["hi"]) != (c["lo"], c["hi"])
    assert a["lo"] <= a["mean"] <= a["hi"]


def test_summarize_drops_missing_and_handles_small_n() -> None:
    s = bs.summarize([None, 2.0, math.nan, 4.0])
    assert s["n"] == 2 and s["mean"] == 3.0 and s["values"] == [2.0, 4.0]
    one = bs.summarize([5.0])
    assert (one["lo"], one["mean"], one["hi"]) == (5.0, 5.0, 5.0)
    none = bs.summarize([None])
    assert none["n"] == 0 and math.isnan(none["mean"])


def test_separated_rule() -> None:
    assert bs.separated((1.0, 2.0), (2.5, 3.0))
    assert bs.separated((2.5, 3.0), (1.0, 2.0))
    assert not bs.separated((1.0, 2.0), (2.0, 3.0)), "touching intervals overlap"
    assert not bs.separated((1.0, 2.5), (2.0, 3.0))
    assert not bs.separated((1.0, math.nan), (5.0, 6.0)), "an unknown bound never separates"
    assert bs.separated((1.5, 1.5), (2.0, 3.0)), "a point outside an interval"


def test_overlapping_seeds_say_not_separated() -> None:
    fast = bs.summarize([1.0, 1.2, 1.4])
    slow = bs.summarize([1.3, 1.5, 1.7])
    assert bs.verdict(fast, slow) == "not separated"
    sentence = bs.compare("A", fast, "B", slow, quantity="s/iter", higher="slower", lower="faster")
    assert sentence == "s/iter: A vs B not separated"
    assert "faster" not in sentence and "slower" not in sentence


def test_distinct_seeds_say_separated_with_direction() -> None:
    fast = bs.summarize([1.0, 1.1, 1.2])
    slow = bs.summarize([2.0, 2.1, 2.2])
    assert bs.verdict(fast, slow) == "separated"
    assert bs.compare("A", fast, "B", slow, quantity="s/iter", higher="slower", lower="faster") == (
        "s/iter: A faster than B (separated)"
    )
    assert bs.compare("B", slow, "A", fast, quantity="reward") == "reward: B higher than A (separated)"


def test_ratio_summary() -> None:
    const = bs.ratio_summary([2.0, 2.0, 2.0], [1.0, 1.0, 1.0])
    assert (const["mean"], const["lo"], const["hi"]) == (2.0, 2.0, 2.0)
    r = bs.ratio_summary([4.0, 6.0], [2.0, 2.0])
    assert r["mean"] == pytest.approx(2.5) and (r["min"], r["max"]) == (2.0, 3.0)
    assert 2.0 <= r["lo"] <= r["mean"] <= r["hi"] <= 3.0
    spread = bs.ratio_summary([170.0, 175.0, 180.0], [70.0, 72.0, 74.0])
    assert spread["mean"] == pytest.approx(175.0 / 72.0)
    assert spread["min"] == pytest.approx(170.0 / 74.0) and spread["max"] == pytest.approx(180.0 / 70.0)
    assert spread["min"] <= spread["lo"] < spread["mean"] < spread["hi"] <= spread["max"]
    assert bs.verdict(spread, (1.0, 1.0)) == "separated"
    assert math.isnan(bs.ratio_summary([1.0], [0.0, 1.0])["mean"]), "a zero time makes the ratio meaningless"
    assert math.isnan(bs.ratio_summary([], [1.0])["mean"])


def test_first_reach() -> None:
    evals = [
        {"iteration": 0, "train_time_s": 0.0, "eval/r": 0.5},
        {"iteration": 5, "train_time_s": 4.0, "eval/r": None},
        {"iteration": 10, "train_time_s": 8.0, "eval/r": 0.7},
        {"iteration": 15, "train_time_s": 12.0, "eval/r": 0.9},
    ]
    hit = bs.first_reach(evals, "eval/r", 0.7)
    assert hit is not None and hit["iteration"] == 10
    assert bs.first_reach(evals, "eval/r", 0.95) is None
    assert bs.first_reach(evals, "eval/other", 0.0) is None
