"""The runner drives toy components (defined in tests/toy_components.py) through the real loop end to end."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from rlpost.apps.host import build_host
from rlpost.core.plugins import PluginHost
from rlpost.engine.recipe import validate
from rlpost.engine.runner import Runner
from tests import toy_components
from tests.toy_components import toy_recipe


@pytest.fixture
def host() -> PluginHost:
    return build_host(load_entrypoints=False, extra_plugins=(toy_components,))


def test_runner_end_to_end(tmp_path, host):
    recipe = validate(toy_recipe(str(tmp_path / "run"), max_steps=3), host)
    runner = Runner(recipe, host)
    history = runner.run()
    assert len(history) == 3
    policy = recipe.model
    assert isinstance(policy, toy_components.ToyPolicy)
    assert policy.a is not None and float(policy.a) != -1.0, "the trainable parameter must move"
    for metrics in history:
        assert all(isinstance(v, float) for v in metrics.values())
        assert metrics["train/edges"] == 2 * 4 * 3
        assert metrics["perf/images"] == 8
    # Before the first optimizer step the recomputed log-probs equal the stored ones: ratio exactly 1.
    assert history[0]["train/first_ratio_dev"] <= 1e-6
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    saved = yaml.safe_load((tmp_path / "run" / "recipe.yaml").read_text())
    assert saved["sampler"]["class_path"] == "tests.toy_components.ToyChainSampler"
    versions = json.loads((tmp_path / "run" / "versions.json").read_text())
    assert versions["packages"]["torch"] == torch.__version__.split("+")[0] or versions["packages"]["torch"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 3


def test_runner_is_deterministic(tmp_path, host):
    a = Runner(validate(toy_recipe(str(tmp_path / "a")), host), host).run()
    b = Runner(validate(toy_recipe(str(tmp_path / "b")), host), host).run()
    assert [m["reward/toy-brightness"] for m in a] == [m["reward/toy-brightness"] for m in b]
    assert [m["loss/policy"] for m in a] == [m["loss/policy"] for m in b]


def test_run_directory_is_never_overwritten(tmp_path, host):
    Runner(validate(toy_recipe(str(tmp_path / "run"), max_steps=1), host), host).run()
    before = (tmp_path / "run" / "recipe.yaml").read_text()
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        Runner(validate(toy_recipe(str(tmp_path / "run"), max_steps=2, seed=5), host), host).run()
    assert (tmp_path / "run" / "recipe.yaml").read_text() == before


def test_nonfinite_reward_is_an_error_naming_the_source(tmp_path, host, monkeypatch):
    recipe = validate(toy_recipe(str(tmp_path / "run"), max_steps=1), host)
    nan_scores = lambda images, prompts, meta: torch.full((len(prompts),), float("nan"))  # noqa: E731
    monkeypatch.setattr(recipe.rewards[0], "score", nan_scores)
    with pytest.raises(FloatingPointError, match="toy-brightness"):
        Runner(recipe, host).run()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed"


def test_several_reward_sources_score_concurrently(tmp_path, host):
    """Two rewards must be inside ``score`` at the same time: each waits at a 2-party barrier, which only opens when
    both run concurrently (sequential scoring would break the barrier after its timeout)."""
    import threading

    recipe = validate(toy_recipe(str(tmp_path / "run"), max_steps=1), host)
    second = toy_components.ToyMeanReward()
    second.name = "toy-brightness-2"  # type: ignore[misc]
    recipe.rewards.append(second)
    recipe.reward_weights["toy-brightness-2"] = 1.0
    barrier = threading.Barrier(2, timeout=30)

    def meeting(original):
        def score(images, prompts, metadata):
            barrier.wait()
            return original(images, prompts, metadata)

        return score

    for reward in recipe.rewards:
        reward.score = meeting(reward.score)  # type: ignore[method-assign]
    runner = Runner(recipe, host)
    runner.setup()
    metrics = runner.step()
    # Two instances of one reward scoring the same images concurrently: equal up to fp32 rounding; scores mixed up
    # between the threads would differ by the spread of the rewards.
    assert metrics["reward/toy-brightness"] == pytest.approx(metrics["reward/toy-brightness-2"], rel=1e-6)
