"""The command line as a person meets it: ``rlpost sample`` needs only the model and its weights, ``--resume latest`` on
a finished run says so with its own exit status, ``--traceback`` shows a failing plugin's traceback, component help
for every registered name, and each subcommand's own ``--help``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file

from rlpost.apps import cli
from rlpost.apps.host import build_host
from rlpost.core.api import RewardSource
from rlpost.core.hookspecs import hookimpl
from rlpost.core.plugins import PluginHost
from rlpost.engine.evaluation import ode_sample
from tests import toy_components
from tests.tolerances import assert_pixels_close
from tests.toy_components import toy_recipe


class FailingReward(RewardSource):
    """Raises from a helper while scoring (the frame to find in the traceback)."""

    name: ClassVar[str] = "cli-failing-reward"

    def score(self, media: torch.Tensor, prompts: Any, metadata: Any) -> torch.Tensor:
        return _deep_inside_the_plugin()


def _deep_inside_the_plugin() -> torch.Tensor:
    raise ValueError("the reward model is on fire")


@hookimpl
def rlpost_register_reward_sources(register: Any) -> None:
    register(FailingReward)


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> PluginHost:
    built = build_host(load_entrypoints=False, extra_plugins=(toy_components, sys.modules[__name__]))
    monkeypatch.setattr(cli, "get_host", lambda: built)
    return built


def _recipe(tmp_path: Path, **changes: Any) -> Path:
    cfg = toy_recipe(str(tmp_path / "run"), max_steps=2)
    cfg.update(changes)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _images(folder: Path) -> list[np.ndarray]:
    return [np.asarray(Image.open(p)) for p in sorted(folder.glob("*.png"))]


# ------------------------------------------------------------------------------------------------- rlpost sample


def test_sample_needs_neither_the_runs_reward_plugins_nor_its_prompt_files(tmp_path, host, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\na dog\n")
    recipe = _recipe(
        tmp_path,
        prompts={"class_path": "prompt-file", "init_args": {"path": str(prompts)}},
        torch_optimizer={"class_path": "torch.optim.SGD", "init_args": {"lr": 30.0}},  # moves the weight visibly
    )
    assert cli.main(["train", "--recipe", str(recipe)]) == 0
    run = tmp_path / "run"
    sample = ["sample", "--run", str(run), "--prompt", "a cat", "--prompt", "a fish", "--seed", "3"]
    assert cli.main([*sample, "--out", str(tmp_path / "before")]) == 0
    before = _images(tmp_path / "before")
    assert len(before) == 2
    # The run moves to a host without its reward plugin and without its prompt file.
    stored = yaml.safe_load((run / "recipe.yaml").read_text())
    stored["rewards"] = [{"class_path": "rlpost_reward_not_installed.rewards.Gone", "init_args": {"x": 1}}]
    (run / "recipe.yaml").write_text(yaml.safe_dump(stored, sort_keys=False))
    prompts.unlink()
    capsys.readouterr()
    assert cli.main([*sample, "--out", str(tmp_path / "after")]) == 0, capsys.readouterr().err
    after = _images(tmp_path / "after")
    assert len(after) == 2 and all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    # Independently: the toy policy with the checkpoint's weight, sampled with the run's eval-less default (the
    # sampler's 3 steps) and seeds 3, 4; the untrained policy samples other images.
    trained = load_file(run / "checkpoints" / "step_000002" / "weights.safetensors")["trainable.0000"]
    expected = {}
    for scale in (float(trained), -1.0):
        policy = toy_components.ToyPolicy(scale=scale)
        policy.setup(torch.device("cpu"))
        expected[scale] = ode_sample(policy, ["a cat", "a fish"], [3, 4], 3, 4)[:, 0].numpy()
    for got, want in zip(after, expected[float(trained)], strict=True):
        assert_pixels_close(got, want)
    assert not all(np.array_equal(a, b) for a, b in zip(after, expected[-1.0], strict=True))


def test_sample_still_names_a_missing_model_plugin(tmp_path, host, capsys):
    recipe = _recipe(tmp_path)
    assert cli.main(["train", "--recipe", str(recipe)]) == 0
    run = tmp_path / "run"
    stored = yaml.safe_load((run / "recipe.yaml").read_text())
    stored["model"] = {"class_path": "no-such-model"}
    (run / "recipe.yaml").write_text(yaml.safe_dump(stored, sort_keys=False))
    capsys.readouterr()
    assert cli.main(["sample", "--run", str(run), "--prompt", "a cat", "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert "model.class_path: unknown model 'no-such-model'" in err and "Traceback" not in err


# ------------------------------------------------------------------------------------- resume of a finished run


def test_resume_latest_of_a_finished_run_says_how_to_extend_it_without_loading_the_model(
    tmp_path, host, monkeypatch, capsys
):
    recipe = _recipe(tmp_path, checkpoint={"every": 1})
    assert cli.main(["train", "--recipe", str(recipe)]) == 0
    run = tmp_path / "run"
    files = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    capsys.readouterr()

    def no_loading(self: Any, device: Any) -> None:
        raise AssertionError("the model must not load for a run with nothing left to do")

    with monkeypatch.context() as patch:
        patch.setattr(toy_components.ToyPolicy, "setup", no_loading)
        assert cli.main(["train", "--recipe", str(recipe), "--resume", "latest"]) == cli.EXIT_NOTHING_TO_DO == 5
        err = capsys.readouterr().err
        assert "nothing left to do" in err and "step_000002 is at step 2 and run.max_steps is 2" in err
        assert "--run.max_steps N (N > 2)" in err and "completed" not in err and "Traceback" not in err
        # A smaller run.max_steps, or the run directory named instead of latest: the same.
        assert cli.main(["train", "--recipe", str(recipe), "--run.max_steps", "1", "--resume", str(run)]) == 5
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == files  # nothing written
    # The way out the message names works.
    assert cli.main(["train", "--recipe", str(recipe), "--run.max_steps", "3", "--resume", "latest"]) == 0
    assert "completed 3 step(s)" in capsys.readouterr().err


def test_exit_statuses_are_documented_in_the_top_level_help(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for status in ("0 done", "2 a bad recipe", "3 stopped by a non-finite guard", "4 a plugin failed", "5 nothing"):
        assert status in out, status


# ---------------------------------------------------------------------------------------------- --traceback


@pytest.mark.parametrize("how", ["default", "option", "environment"])
def test_a_raising_reward_plugin_shows_its_traceback_on_request(tmp_path, host, monkeypatch, capsys, how):
    monkeypatch.delenv(cli.TRACEBACK_ENV, raising=False)
    recipe = _recipe(tmp_path, rewards=[{"class_path": "cli-failing-reward"}])
    argv = ["train", "--recipe", str(recipe)]
    if how == "option":
        argv.append("--traceback")
    elif how == "environment":
        monkeypatch.setenv(cli.TRACEBACK_ENV, "1")
    assert cli.main(argv) == 4
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # the one line naming the plugin stays the last
    assert last.startswith("rlpost train: reward 'cli-failing-reward'") and "the reward model is on fire" in last
    if how == "default":
        assert "Traceback" not in err and "--traceback or RLPOST_TRACEBACK=1 shows" in last
    else:  # the plugin's own frames, down to the line that raised
        assert "Traceback (most recent call last)" in err and "ValueError: the reward model is on fire" in err
        assert "_deep_inside_the_plugin" in err and 'raise ValueError("the reward model is on fire")' in err


# --------------------------------------------------------------------------------------------------- help


def _help(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """What ``rlpost ARGV`` prints on stdout, exiting 0 (argparse's help exits through SystemExit, as the console
    script does)."""
    try:
        status = cli.main(argv)
    except SystemExit as exc:
        status = exc.code or 0
    captured = capsys.readouterr()
    assert status == 0, captured.err
    return captured.out


def test_component_help_works_for_every_registered_name(capsys):
    from rlpost.apps.host import get_host
    from rlpost.engine.recipe.names import NAMED_HELP_OPTIONS

    host = get_host()
    options: dict[str, str] = {}
    for key, kind in NAMED_HELP_OPTIONS.items():
        options.setdefault(kind, key)
    tried = []
    for kind, key in options.items():
        for name in host.registry(kind).names():
            out = _help(capsys, ["train", f"--{key}.help", name])
            line = next((x for x in out.splitlines() if x.startswith(f"Help for --{key}.help=")), "")
            assert line.endswith("." + host.registry(kind).get(name).cls.__name__), (key, name, out[:300])
            tried.append(name)
    assert "hps-v2.1" in tried  # a registered name with a dot in it


SUBCOMMANDS = {
    "train": "Train with a recipe",
    "validate": "Validate a recipe",
    "sample": "Generate PNGs",
    "export": "Write a run's diffusers-loadable weights",
    "plugins": "List plugins",
    "recipes": "List the shipped recipes",
    "bench": "TreeGRPO, DanceGRPO, MixGRPO and DDPO side by side",
}


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_each_subcommand_help_is_its_own(command, capsys):
    out = _help(capsys, [command, "--help"])
    assert out.startswith(f"usage: rlpost {command} "), out[:200]
    assert SUBCOMMANDS[command] in " ".join(out.split()), out[:600]
    assert "``" not in out
    if command == "validate":  # train's own options are not validate's
        assert "--resume" not in out and "--print_config" not in out and "--recipe RECIPE" in out
    if command == "train":
        assert "--resume" in out and "--print_config" in out and "--traceback" in out


def test_plugins_list_help_is_its_own(capsys):
    out = _help(capsys, ["plugins", "list", "--help"])
    assert out.startswith("usage: rlpost plugins list") and "--json" in out
