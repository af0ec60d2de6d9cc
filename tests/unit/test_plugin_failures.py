"""Run-time plugin failures name the plugin: a reward of the wrong length or type or one that raises, a lifecycle hook
that raises, plugin state that cannot be saved without pickle. The guards policy decides skip vs stop for rewards;
the last good checkpoint always stays intact."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import yaml
from torch import Tensor

from rlpost import hookimpl
from rlpost.apps.host import build_host, reset_host
from rlpost.core.api import RewardSource
from rlpost.core.plugin_errors import PluginRuntimeError
from rlpost.core.plugins import PluginHost
from rlpost.engine.checkpoint import list_checkpoints, verify_checkpoint
from rlpost.engine.recipe import validate
from rlpost.engine.runner import Runner
from tests import toy_components
from tests.toy_components import toy_recipe

FAIL_AT_STEP = 1  # completed steps when the fault fires (0-based step index)


class FlakyReward(RewardSource):
    """Brightness, except at ``FAIL_AT_STEP`` where it misbehaves the way ``mode`` says."""

    name: ClassVar[str] = "flaky-reward"

    def __init__(self, mode: str = "raise") -> None:
        self.mode = mode
        self.calls = 0

    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Any:
        call, self.calls = self.calls, self.calls + 1
        good = images.float().mean(dim=(1, 2, 3)) / 255.0
        if call != FAIL_AT_STEP:
            return good
        if self.mode == "raise":
            raise ConnectionError("scoring server went away")
        if self.mode == "short":
            return good[:-1]
        return good.tolist()  # "list": the wrong type


class RewardPlugin:
    @hookimpl
    def rlpost_register_reward_sources(self, register: Any) -> None:
        register(FlakyReward)


class HookPlugin:
    """Lifecycle plugin whose ``rlpost_after_step`` raises at ``FAIL_AT_STEP`` or whose saved state is not JSON."""

    def __init__(self, fail_hook: bool = False, bad_state: bool = False) -> None:
        self.fail_hook, self.bad_state = fail_hook, bad_state

    @hookimpl
    def rlpost_after_step(self, run: Any, metrics: Any) -> None:
        if self.fail_hook and run.step == FAIL_AT_STEP + 1:
            raise KeyError("wandb_run")

    @hookimpl
    def rlpost_after_run(self, run: Any, status: str) -> None:
        if self.fail_hook:
            raise RuntimeError("flush failed")

    @hookimpl
    def rlpost_save_state(self, run: Any, state: dict[str, Any]) -> None:
        state["hookplugin"] = {"step": run.step, "seen": {1, 2} if self.bad_state and run.step > 1 else [1, 2]}


def _host(*extra: object) -> PluginHost:
    return build_host(load_entrypoints=False, extra_plugins=(toy_components, RewardPlugin(), *extra))


def _cfg(tmp_path: Path, policy: str, mode: str | None = None, steps: int = 3) -> dict[str, Any]:
    cfg = toy_recipe(str(tmp_path / "run"), max_steps=steps)
    cfg["guards"] = {"on_nonfinite": policy}
    cfg["checkpoint"] = {"every": 1}
    if mode is not None:
        cfg["rewards"] = [{"class_path": "flaky-reward", "init_args": {"mode": mode}}]
    return cfg


@pytest.mark.parametrize("mode", ["raise", "short", "list"])
def test_failing_reward_is_skipped_under_skip_policy(tmp_path, mode):
    host = _host()
    runner = Runner(validate(_cfg(tmp_path, "skip", mode), host), host)
    history = runner.run()
    assert len(history) == 3
    assert [m["guard/plugin_failures"] for m in history] == [0.0, 1.0, 0.0]
    assert history[2]["guard/skipped_steps"] == 1
    assert runner.recipe.model.a is not None and torch.isfinite(runner.recipe.model.a).all()


@pytest.mark.parametrize(
    ("mode", "why"),
    [
        ("raise", "raised ConnectionError: scoring server went away"),
        ("short", r"returned shape \(7,\), expected \(8,\)"),
        ("list", r"returned list, expected a torch.Tensor of shape \(8,\)"),
    ],
)
def test_failing_reward_stops_naming_plugin_under_stop_policy(tmp_path, mode, why):
    host = _host()
    runner = Runner(validate(_cfg(tmp_path, "stop", mode), host), host)
    with pytest.raises(PluginRuntimeError, match=f"reward 'flaky-reward' of plugin 'RewardPlugin-1'.*{why}") as info:
        runner.run()
    assert info.value.distribution == "<local>" and info.value.plugin == "RewardPlugin-1"
    ckpts = list_checkpoints(tmp_path / "run")
    assert [c.step for c in ckpts][-1] == 2 and ckpts[-1].manifest["reason"] == "guard-stop"
    for ckpt in ckpts:
        verify_checkpoint(ckpt)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"


def test_raising_hook_names_its_plugin_and_keeps_last_checkpoint(tmp_path):
    host = _host(HookPlugin(fail_hook=True))
    runner = Runner(validate(_cfg(tmp_path, "stop"), host), host)
    with (
        pytest.warns(UserWarning, match=r"hook rlpost_after_run of plugin 'HookPlugin-2'.*while the run was failed"),
        pytest.raises(PluginRuntimeError, match=r"hook rlpost_after_step of plugin 'HookPlugin-2'.*KeyError") as info,
    ):
        runner.run()
    assert info.value.distribution == "<local>"
    (ckpt,) = list_checkpoints(tmp_path / "run")
    assert ckpt.step == 1
    verify_checkpoint(ckpt)


def test_unsaveable_plugin_state_names_plugin_and_keeps_last_checkpoint(tmp_path):
    host = _host(HookPlugin(bad_state=True))
    runner = Runner(validate(_cfg(tmp_path, "stop"), host), host)
    with pytest.raises(
        PluginRuntimeError, match=r"hook rlpost_save_state of plugin 'HookPlugin-2'.*state\['hookplugin'\].*set"
    ):
        runner.run()
    (ckpt,) = list_checkpoints(tmp_path / "run")
    assert ckpt.step == 1
    verify_checkpoint(ckpt)
    assert not [p for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.startswith(".")]


def test_cli_prints_one_line_naming_the_plugin(tmp_path, capsys):
    from rlpost.apps.cli import main

    host = _host()
    cfg = _cfg(tmp_path, "stop", "short")
    cfg["run"]["progress"] = False
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(cfg))
    reset_host(host)
    try:
        status = main(["train", "--recipe", str(recipe)])
    finally:
        reset_host(None)
    assert status == 4
    stderr = capsys.readouterr().err
    err = [line for line in stderr.splitlines() if line.startswith("rlpost train:")]
    assert len(err) == 1 and "'flaky-reward'" in err[0] and "distribution '<local>'" in err[0]
    assert "Traceback" not in stderr


def test_raising_hook_before_the_first_checkpoint_leaves_a_run_to_restart(tmp_path, capsys):
    from rlpost.apps.cli import main

    cfg = _cfg(tmp_path, "stop")
    cfg["checkpoint"] = {"every": 0}  # the hook fails at step 2, before any checkpoint
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(cfg))
    reset_host(_host(HookPlugin(fail_hook=True)))
    try:
        with pytest.warns(UserWarning, match="rlpost_after_run"):
            assert main(["train", "--recipe", str(recipe)]) == 4
        reset_host(_host())  # the plugin fixed
        capsys.readouterr()
        # A new run would overwrite the logged steps: refused, pointing at the way that works ...
        assert main(["train", "--recipe", str(recipe)]) == 2
        err = capsys.readouterr().err
        assert "refusing to overwrite" in err and "--resume latest starts it again from step 0" in err
        # ... which restarts the run from step 0 in its directory.
        with pytest.warns(UserWarning, match="restarting the run from step 0"):
            assert main(["train", "--recipe", str(recipe), "--resume", "latest"]) == 0
    finally:
        reset_host(None)
    run = tmp_path / "run"
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"
    host = _host()
    fresh = Runner(
        validate(toy_recipe(str(tmp_path / "fresh"), max_steps=3) | {"checkpoint": {"every": 0}}, host), host
    )
    untimed = [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in fresh.run()]
    logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in m.items() if not k.startswith("perf/") and k != "step"} for m in logged] == untimed
