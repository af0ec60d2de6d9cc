"""Non-finite guards: injected NaN rewards and losses follow guards.on_nonfinite (skip: counted, continue;
stop: checkpoint saved, then a clear error); non-finite weights never reach a checkpoint."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from rlpost.apps.host import build_host
from rlpost.core.api import EdgeEval
from rlpost.core.plugins import PluginHost
from rlpost.engine.checkpoint import CheckpointError, list_checkpoints
from rlpost.engine.guards import NonFiniteError
from rlpost.engine.recipe import RecipeError, validate
from rlpost.engine.runner import Runner
from tests import toy_components
from tests.toy_components import toy_recipe


@pytest.fixture
def host() -> PluginHost:
    return build_host(load_entrypoints=False, extra_plugins=(toy_components,))


def _runner(tmp_path, host, policy: str, steps: int = 3) -> Runner:
    cfg = toy_recipe(str(tmp_path / "run"), max_steps=steps)
    cfg["guards"] = {"on_nonfinite": policy}
    return Runner(validate(cfg, host), host)


def _nan_reward_at_step(runner: Runner, bad_step: int, monkeypatch) -> None:
    reward = runner.recipe.rewards[0]
    original = reward.score

    def score(images, prompts, meta):
        values = original(images, prompts, meta)
        if runner.ctx.step == bad_step:
            values[1] = float("nan")
        return values

    monkeypatch.setattr(reward, "score", score)


def _nan_loss_at_step(runner: Runner, bad_step: int, monkeypatch) -> None:
    sampler = runner.recipe.sampler
    original = sampler.evaluate

    def evaluate(policy, rollout, edges):
        out = original(policy, rollout, edges)
        if runner.ctx.step == bad_step:
            return EdgeEval(out.log_prob * float("nan"), out.mean, out.std, out.forwards)
        return out

    monkeypatch.setattr(sampler, "evaluate", evaluate)


@pytest.mark.parametrize("inject", [_nan_reward_at_step, _nan_loss_at_step], ids=["reward", "loss"])
def test_skip_counts_and_continues(tmp_path, host, monkeypatch, inject):
    runner = _runner(tmp_path, host, "skip")
    inject(runner, 1, monkeypatch)
    history = runner.run()
    assert len(history) == 3
    what = "reward" if inject is _nan_reward_at_step else "loss"
    assert history[1][f"guard/nonfinite_{what}"] >= 1
    assert history[0][f"guard/nonfinite_{what}"] == 0 and history[2][f"guard/nonfinite_{what}"] == 0
    assert history[2]["guard/skipped_steps"] == 1
    assert runner.recipe.model.a is not None and torch.isfinite(runner.recipe.model.a).all()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines[1][f"guard/nonfinite_{what}"] >= 1


@pytest.mark.parametrize("inject", [_nan_reward_at_step, _nan_loss_at_step], ids=["reward", "loss"])
def test_stop_saves_checkpoint_then_fails_clearly(tmp_path, host, monkeypatch, inject):
    runner = _runner(tmp_path, host, "stop")
    inject(runner, 1, monkeypatch)
    what = "reward" if inject is _nan_reward_at_step else "loss"
    with pytest.raises(NonFiniteError, match=f"non-finite {what}.*on_nonfinite=stop.*checkpoint"):
        runner.run()
    (ckpt,) = list_checkpoints(tmp_path / "run")
    assert ckpt.step == 2 and ckpt.manifest["reason"] == "guard-stop"
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"


def test_nonfinite_advantages_are_zeroed_and_counted(tmp_path, host, monkeypatch):
    runner = _runner(tmp_path, host, "skip", steps=1)
    estimator = runner.recipe.advantage
    original = estimator.estimate

    def estimate(rollout, scores):
        adv = original(rollout, scores)
        adv.edges[0] = float("inf")
        return adv

    monkeypatch.setattr(estimator, "estimate", estimate)
    (metrics,) = runner.run()
    assert metrics["guard/nonfinite_advantage"] == 1 and metrics["loss/policy"] == metrics["loss/policy"]


def test_nonfinite_weights_are_never_checkpointed(tmp_path, host):
    runner = _runner(tmp_path, host, "stop", steps=1)
    runner.setup()
    with torch.no_grad():
        runner.recipe.model.a.fill_(float("nan"))  # type: ignore[union-attr]
    with pytest.raises(CheckpointError, match="non-finite weights"):
        runner.save_checkpoint()
    assert list_checkpoints(tmp_path / "run") == []


def test_guard_policy_is_validated(tmp_path, host, monkeypatch):
    cfg = toy_recipe(str(tmp_path))
    cfg["guards"] = {"on_nonfinite": "ignore"}
    cfg["checkpoint"] = {"keep_last": -1}
    # A tracker whose package is absent is named (here made absent; the deprecated boolean still selects it).
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    cfg["logging"] = {"wandb": True}
    with pytest.raises(RecipeError) as err:
        validate(cfg, host)
    text = str(err.value)
    assert "guards" in text and "checkpoint.keep_last: must be >= 0" in text
    assert "logging.report_to[0]: 'wandb': the 'wandb' package is not installed (pip install 'rlpost[wandb]')" in text
