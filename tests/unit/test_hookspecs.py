"""Every hook spec has a test here named ``test_hook_<hookname>`` (checked by tests/meta/test_hooks_tested.py)."""

from __future__ import annotations

from typing import Any

import pytest

from rlpost import RunStatus, hookimpl
from rlpost.apps.host import build_host
from rlpost.core.plugins import PluginHost
from rlpost.engine.recipe import validate
from rlpost.engine.runner import Runner
from tests import toy_components
from tests.toy_components import toy_recipe


class Probe:
    """Records every lifecycle hook call in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.loaded: dict[str, Any] | None = None

    @hookimpl
    def rlpost_before_run(self, run):
        self.calls.append(("before_run", {"step": run.step}))

    @hookimpl
    def rlpost_after_rollout(self, run, rollout):
        self.calls.append(("after_rollout", {"samples": rollout.num_samples, "edges": rollout.num_edges}))

    @hookimpl
    def rlpost_after_rewards(self, run, rollout, scores):
        self.calls.append(("after_rewards", {"sources": sorted(scores.scores)}))

    @hookimpl
    def rlpost_after_advantages(self, run, rollout, advantages):
        self.calls.append(("after_advantages", {"edges": int(advantages.edges.numel())}))

    @hookimpl
    def rlpost_after_step(self, run, metrics):
        self.calls.append(("after_step", {"step": run.step, "has_reward": "reward/toy-brightness" in metrics}))

    @hookimpl
    def rlpost_after_run(self, run, status):
        self.calls.append(("after_run", {"status": status}))

    @hookimpl
    def rlpost_save_state(self, run, state):
        state["probe"] = {"seen_steps": run.step}

    @hookimpl
    def rlpost_load_state(self, run, state):
        self.loaded = dict(state)


@pytest.fixture
def probed(tmp_path):
    probe = Probe()
    host = build_host(load_entrypoints=False, extra_plugins=(toy_components,))
    host.register_plugin(probe, name="probe")
    runner = Runner(validate(toy_recipe(str(tmp_path / "run"), max_steps=2), host), host)
    runner.run()
    return probe, runner, host


def _names(probe: Probe) -> list[str]:
    return [name for name, _ in probe.calls]


def test_hook_rlpost_before_run(probed):
    probe, _, _ = probed
    assert probe.calls[0] == ("before_run", {"step": 0})


def test_hook_rlpost_after_rollout(probed):
    probe, _, _ = probed
    rollouts = [kw for name, kw in probe.calls if name == "after_rollout"]
    assert rollouts == [{"samples": 8, "edges": 24}] * 2


def test_hook_rlpost_after_rewards(probed):
    probe, _, _ = probed
    assert [kw for name, kw in probe.calls if name == "after_rewards"] == [{"sources": ["toy-brightness"]}] * 2


def test_hook_rlpost_after_advantages(probed):
    probe, _, _ = probed
    assert [kw for name, kw in probe.calls if name == "after_advantages"] == [{"edges": 24}] * 2


def test_hook_rlpost_after_step(probed):
    probe, _, _ = probed
    assert [kw for name, kw in probe.calls if name == "after_step"] == [
        {"step": 1, "has_reward": True},
        {"step": 2, "has_reward": True},
    ]
    # Lifecycle order within a step.
    assert _names(probe)[1:5] == ["after_rollout", "after_rewards", "after_advantages", "after_step"]


def test_hook_rlpost_after_run(probed):
    probe, runner, _ = probed
    assert probe.calls[-1] == ("after_run", {"status": "completed"})
    status = probe.calls[-1][1]["status"]
    assert status is RunStatus.COMPLETED is runner.status  # typed, and equal to the plain string
    assert {s.value for s in RunStatus} == {"completed", "stopped", "failed", "interrupted"}
    with pytest.raises(ValueError, match="'done' is not a valid RunStatus"):
        runner.finish("done")


def test_hook_rlpost_after_run_reports_failure(tmp_path):
    probe = Probe()
    host = build_host(load_entrypoints=False, extra_plugins=(toy_components,))
    host.register_plugin(probe, name="probe")
    recipe = validate(toy_recipe(str(tmp_path / "run"), max_steps=1), host)
    recipe.rewards[0].score = lambda *a: (_ for _ in ()).throw(RuntimeError("reward server down"))  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="reward server down"):
        Runner(recipe, host).run()
    assert probe.calls[-1] == ("after_run", {"status": "failed"})
    assert probe.calls[-1][1]["status"] is RunStatus.FAILED


def test_hook_rlpost_save_state(probed):
    _, runner, _ = probed
    state = runner.state()
    assert state["plugins"]["probe"] == {"seen_steps": 2}
    assert state["step"] == 2


def test_hook_rlpost_load_state(probed):
    probe, runner, _ = probed
    state = runner.state()
    runner.load_state(state)
    assert probe.loaded == {"probe": {"seen_steps": 2}}


def _registration_host(hook_name: str, cls: type) -> PluginHost:
    class Plugin:
        pass

    def impl(register):
        register(cls)

    setattr(Plugin, hook_name, staticmethod(hookimpl(impl)))
    return build_host(load_entrypoints=False, extra_plugins=(Plugin(),))


def test_hook_rlpost_register_samplers():
    host = _registration_host("rlpost_register_samplers", toy_components.ToyChainSampler)
    assert host.registry("sampler").get("toy-chain").cls is toy_components.ToyChainSampler


def test_hook_rlpost_register_advantage_estimators():
    host = _registration_host("rlpost_register_advantage_estimators", toy_components.ToyGroupAdvantage)
    assert "toy-group" in host.registry("advantage")


def test_hook_rlpost_register_reward_sources():
    host = _registration_host("rlpost_register_reward_sources", toy_components.ToyMeanReward)
    entry = host.registry("reward").get("toy-brightness")
    assert entry.distribution == "<local>"


def test_hook_rlpost_register_optimizers():
    # The core registers the shared clipped-surrogate rule through this hook.
    host = build_host(load_entrypoints=False)
    entry = host.registry("optimizer").get("clipped-surrogate")
    assert entry.plugin == "rlpost.components.builtin" and entry.distribution == "rlpost"


def test_hook_rlpost_register_models():
    host = _registration_host("rlpost_register_models", toy_components.ToyPolicy)
    assert "toy-policy" in host.registry("model")


def test_hook_rlpost_register_prompt_sources():
    host = build_host(load_entrypoints=False)
    assert {"prompt-list", "prompt-file", "hf-dataset"} <= set(host.registry("prompts").names())
