"""The speed-ups on the tiny SD3 build give the plain path's rewards, advantages and log-probs within the tolerances
docs/speed.md states, and the ratio guard (rlpost/engine/ratio_guard.py) passes them, refuses a planted lossy speed-up
with an error naming it, and leaves the run as it found it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rlpost.apps.host import build_host
from rlpost.engine import runner as runner_module
from rlpost.engine.ratio_guard import RatioCheck, RatioGuardEmptyError, SpeedupRatioError, training_path_ratios
from rlpost.engine.recipe import RecipeError, parse_recipe, validate
from rlpost.engine.runner import Runner
from rlpost.models.acceleration import Speedups
from tests.tolerances import FP32_ATOL, PIXEL_ATOL

ROOT = Path(__file__).resolve().parents[2]
TINY_TREE = str(ROOT / "recipes" / "tiny" / "treegrpo.yaml")
TINY_DANCE = str(ROOT / "recipes" / "tiny" / "dancegrpo.yaml")
SMOOTH_REWARD = ("rewards", "[{class_path: tests.toy_components.ToyMeanReward}]")
"""Mean brightness: a one-level pixel flip moves it by 1/255/3072, where a JPEG size can jump by many bytes."""


# (speed-up overrides, tolerances) -- docs/speed.md "What each speed-up changes" states the same bounds.
FP32_KERNEL = {"images": PIXEL_ATOL, "rewards": 1e-4, "advantages": 2e-2, "log_probs": 1e-6, "ratio": 1e-6}
"""Another fp32 kernel (compiled, another attention kernel, channels-last convolutions): measured on the tiny SD3
at most one pixel level, 1.3e-6 in reward, 1.5e-3 in advantage (a z-score over four near-equal rewards magnifies a
flipped pixel), 2e-8 in log-prob and 2e-9 in ratio."""
BF16_AUTOCAST = {"images": 16, "rewards": 2e-3, "advantages": 0.5, "log_probs": 1e-6, "ratio": 1e-4}
"""bf16 autocast on both paths: states and images move by bf16 rounding (measured 4 levels, 7e-5 in reward, 0.05 in
advantage); a child's old log-prob depends on its noise draw and the step's std only, so it stays at fp32 rounding;
the ratio stays 1 because both paths round alike (measured 3.6e-6)."""

SPEEDUPS: dict[str, tuple[list[tuple[str, str]], dict[str, float]]] = {
    "attention-math": ([("run.speedups.attention_backend", "_native_math")], FP32_KERNEL),
    "vae-channels-last": ([("run.speedups.vae_channels_last", "true")], FP32_KERNEL),
    "autocast-bf16": ([("run.speedups.autocast", "bfloat16")], BF16_AUTOCAST),
}
COMPILED = {
    "compile-rollout": ([("run.speedups.compile", "rollout")], FP32_KERNEL),
    "compile-train": ([("run.speedups.compile", "train")], FP32_KERNEL),
    "compile-both": ([("run.speedups.compile", "both")], FP32_KERNEL),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    yield
    torch._dynamo.reset()


def _runner(tmp_path: Path, recipe: str, pairs: list[tuple[str, str]], name: str = "run") -> Runner:
    host = build_host()
    cfg = parse_recipe([recipe], [*pairs, SMOOTH_REWARD, ("run.output_dir", str(tmp_path / name))], host)
    return Runner(validate(cfg, host), host)


def _first_step(runner: Runner) -> dict[str, torch.Tensor]:
    """Set up, then the first step's rollout, rewards, advantages and training-path log-probs (as the update)."""
    runner.setup()
    r = runner.recipe
    assert runner.stream is not None
    batch = runner.stream.next_batch(r.run.groups_per_step, r.run.samples_per_group)
    with torch.no_grad():
        rollout = runner.shard.rollout(r.sampler, r.model, batch, 0)
    scores = runner.score(rollout)
    advantages = r.advantage.estimate(rollout, scores)
    edges = torch.nonzero(rollout.trainable).flatten()
    ratio = training_path_ratios(r.model, r.sampler, rollout, 0)
    return {
        "images": rollout.media.int(),
        "rewards": scores.weighted_sum(),
        "advantages": advantages.edges[edges],
        "log_probs": rollout.old_log_probs[edges],
        "ratio": ratio,
    }


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for recipe in (TINY_TREE, TINY_DANCE):
        out[recipe] = _first_step(_runner(tmp_path_factory.mktemp("plain"), recipe, []))
    return out


def _compare(fast: dict[str, torch.Tensor], plain: dict[str, torch.Tensor], tol: dict[str, float]) -> None:
    for key in ("images", "rewards", "advantages", "log_probs"):
        diff = float((fast[key].double() - plain[key].double()).abs().max())
        assert diff <= tol[key], f"{key}: {diff} > {tol[key]}"
    assert float((fast["ratio"] - 1).abs().max()) <= tol["ratio"]
    assert float((plain["ratio"] - 1).abs().max()) <= FP32_KERNEL["ratio"]  # the plain path itself


@pytest.mark.parametrize("recipe", [TINY_TREE, TINY_DANCE], ids=["tree", "dance"])
@pytest.mark.parametrize("speedup", list(SPEEDUPS))
def test_speedup_matches_the_plain_path(speedup: str, recipe: str, plain: dict[str, Any], tmp_path: Path) -> None:
    pairs, tol = SPEEDUPS[speedup]
    runner = _runner(tmp_path, recipe, pairs)
    _compare(_first_step(runner), plain[recipe], tol)
    check = runner.ratio_check
    assert isinstance(check, RatioCheck) and check.passed and check.edges > 0  # a policy-gradient rule's guard
    assert check.max_error <= tol["ratio"]


@pytest.mark.slow
@pytest.mark.parametrize("speedup", list(COMPILED))
def test_compiled_transformer_matches_the_plain_path(speedup: str, plain: dict[str, Any], tmp_path: Path) -> None:
    """torch.compile (inductor on the CPU) of the tiny SD3's blocks, per path: 15-40 s of compilation each."""
    pairs, tol = COMPILED[speedup]
    runner = _runner(tmp_path, TINY_TREE, pairs)
    _compare(_first_step(runner), plain[TINY_TREE], tol)
    assert runner.ratio_check is not None and runner.ratio_check.passed


# ------------------------------------------------------------------------------------------------ the guard


def _planted(monkeypatch: pytest.MonkeyPatch, factor: float) -> None:
    """A lossy speed-up planted for the test: rollout (no-grad) velocities ``factor`` times too large."""
    honest = Speedups.call

    def lossy(self: Speedups, module: Any, *args: Any, **kwargs: Any) -> Any:
        out = honest(self, module, *args, **kwargs)
        return out if torch.is_grad_enabled() else tuple(o * factor for o in out)

    monkeypatch.setattr(Speedups, "call", lossy)


@pytest.mark.parametrize("recipe", [TINY_TREE, TINY_DANCE], ids=["tree", "dance"])
def test_guard_refuses_a_planted_lossy_speedup(recipe: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _planted(monkeypatch, 1.1)
    runner = _runner(tmp_path, recipe, [("run.speedups.attention_backend", "_native_math")])
    with pytest.raises(SpeedupRatioError) as info:
        runner.setup()
    check = info.value.check
    assert check.max_error > check.tolerance == 1e-3 and not check.passed
    text = str(info.value)
    assert "run.speedups: the speed-ups ['attention_backend=_native_math']" in text
    assert f"max |ratio - 1| = {check.max_error:.3g}" in text and "ratio_tolerance = 0.001" in text


def test_the_tolerance_decides(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The same planted error passes a tolerance above it: the guard compares with the recipe's number."""
    _planted(monkeypatch, 1.1)
    runner = _runner(
        tmp_path,
        TINY_DANCE,
        [("run.speedups.attention_backend", "_native_math"), ("run.speedups.ratio_tolerance", "0.5")],
    )
    runner.setup()
    assert runner.ratio_check is not None and 1e-3 < runner.ratio_check.max_error <= 0.5


def test_a_guard_rollout_without_measurable_edges_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rollout whose trainable edges all lack a finite log-prob leaves the ratio guard nothing to measure: the run
    is refused (exit 2) naming why, instead of passing every speed-up unchecked."""
    from rlpost.apps import cli
    from rlpost_dancegrpo.sampler import DanceGRPOSampler

    honest = DanceGRPOSampler.rollout

    def unmeasurable(self: DanceGRPOSampler, *args: Any, **kwargs: Any) -> Any:
        out = honest(self, *args, **kwargs)
        out.old_log_probs = torch.full_like(out.old_log_probs, float("nan"))
        return out

    monkeypatch.setattr(DanceGRPOSampler, "rollout", unmeasurable)
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    argv = ["train", "--recipe", TINY_DANCE, "--run.output_dir", str(out), "--run.speedups.vae_channels_last", "true"]
    assert cli.main([*argv, "--rewards", SMOOTH_REWARD[1]]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert (
        "run.speedups: the ratio guard has nothing to measure: the guard's rollout of 1 group(s) has no trainable "
        "edge with a finite log-prob (sampler 'dance': none of its 8 trainable edge(s) has a finite old log-prob for "
        "this draw), so the speed-ups ['vae_channels_last'] cannot be checked"
    ) in err
    assert "Raise run.speedups.guard_groups" in err and "Traceback" not in err
    assert not (out / "metrics.jsonl").exists()
    assert issubclass(RatioGuardEmptyError, RecipeError)


def test_train_refuses_before_the_first_step(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rlpost.apps import cli

    _planted(monkeypatch, 1.1)
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    argv = ["train", "--recipe", TINY_DANCE, "--run.output_dir", str(out), "--run.speedups.autocast", "bfloat16"]
    assert cli.main([*argv, "--rewards", SMOOTH_REWARD[1]]) == 2
    assert "run.speedups: the speed-ups ['autocast=bfloat16 (both)']" in capsys.readouterr().err
    assert not (out / "metrics.jsonl").exists()


def test_the_measurement_is_a_metric_and_in_the_summary(tmp_path: Path) -> None:
    runner = _runner(tmp_path, TINY_TREE, [("run.speedups.vae_channels_last", "true"), ("run.max_steps", "1")])
    history = runner.run()
    assert runner.ratio_check is not None
    assert history[0]["accelerate/ratio_error"] == runner.ratio_check.max_error
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["metrics"]["accelerate/ratio_error"]["last"] == runner.ratio_check.max_error
    plain = _runner(tmp_path, TINY_TREE, [("run.max_steps", "1")], name="plain")
    assert "accelerate/ratio_error" not in plain.run()[0] and plain.ratio_check is None


def _state(runner: Runner) -> dict[str, Any]:
    r = runner.recipe
    assert runner.stream is not None
    return {
        "rollout_gen": runner.rollout_gen.get_state(),
        "minibatch_gen": runner.minibatch_gen.get_state(),
        "global": torch.random.get_rng_state(),
        "stream": runner.stream.state_dict(),
        "sampler": r.sampler.state_dict(),
        "window_start": getattr(r.sampler, "window_start", None),
        "cached_prompts": len(r.model._cache),  # type: ignore[attr-defined]
    }


def test_the_guard_leaves_the_run_as_it_found_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every RNG stream, the prompt stream, the sampler's state and the prompt cache are as without the guard, so the
    first step gives the same rewards."""
    pairs = [("run.speedups.autocast", "bfloat16")]
    guarded = _runner(tmp_path, TINY_TREE, pairs, name="guarded")
    guarded.setup()
    assert guarded.ratio_check is not None
    monkeypatch.setattr(runner_module, "check_speedups", lambda *args: None)
    unguarded = _runner(tmp_path, TINY_TREE, pairs, name="unguarded")
    unguarded.setup()
    a, b = _state(guarded), _state(unguarded)
    for key in ("rollout_gen", "minibatch_gen", "global"):
        assert torch.equal(a.pop(key), b.pop(key)), key
    assert a == b and a["cached_prompts"] == 0
    rewards = [r.step()["reward/toy-brightness"] for r in (guarded, unguarded)]
    assert abs(rewards[0] - rewards[1]) <= FP32_ATOL


def test_counted_rows_still_equal_the_closed_form(tmp_path: Path) -> None:
    """The guard's forwards happen at set-up; each step's counted transformer rows (``forward_count``, what the bench
    reads) still equal the sampler's closed-form counts with a speed-up on."""
    runner = _runner(tmp_path, TINY_TREE, [("run.speedups.autocast", "bfloat16")])
    runner.setup()
    r = runner.recipe
    for _ in range(2):
        before = r.model.forward_count
        runner.step()
        counts = r.sampler.step_counts(r.run.groups_per_step, r.run.samples_per_group)
        assert runner.last_update is not None
        assert runner.last_update.result.train_forwards == counts.train_forwards
        assert r.model.forward_count - before == counts.rollout_forwards + counts.train_forwards
