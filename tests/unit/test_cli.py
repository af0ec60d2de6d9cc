"""The ``rlpost`` command line itself: version, help, component help, plugin listing."""

from __future__ import annotations

import importlib.metadata
import logging
import os
from pathlib import Path

import yaml

from rlpost.apps import cli
from rlpost.apps.host import build_host
from tests import toy_components
from tests.toy_components import toy_recipe


def test_version_prints_the_installed_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"rlpost {importlib.metadata.version('rlpost')}"


def test_component_help_by_registered_name_prints_that_components_options(capsys):
    assert cli.main(["train", "--sampler.help", "tree"]) == 0
    out = capsys.readouterr().out
    assert "--sampler.k K" in out and "--sampler.depth DEPTH" in out
    assert "``" not in out  # reST markup is stripped from the docstring help
    assert cli.main(["train", "--prompts.help", "hf-dataset"]) == 0
    assert "--prompts.limit" in capsys.readouterr().out


def test_component_help_for_an_unknown_name_suggests_the_nearest(capsys):
    assert cli.main(["train", "--sampler.help", "tre"]) == 2
    assert "did you mean 'tree'" in capsys.readouterr().err


def test_train_help_lists_the_command_line_options_and_the_eval_section(capsys):
    assert cli.main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--recipe", "--resume", "--print_config", "--sampler.help", "--eval.prompts", "--eval.num_steps"):
        assert option in out, option
    assert "``" not in out


def test_top_level_help_goes_to_stdout(capsys):
    assert cli.main(["--help"]) == 0
    captured = capsys.readouterr()
    assert "rlpost train" in captured.out and captured.err == ""


def test_validate_on_a_bench_recipe_points_to_rlpost_bench(capsys):
    bench = Path(__file__).resolve().parents[2] / "recipes" / "bench" / "tiny.yaml"
    assert cli.main(["validate", "--recipe", str(bench)]) == 2
    err = capsys.readouterr().err
    assert "bench recipe" in err and "rlpost bench --recipe" in err
    assert "unknown top-level key" not in err


def test_plugins_list_piped_does_not_truncate(capsys):
    assert cli.main(["plugins", "list"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out
    assert "rlpost_register_advantage_estimators" in out
    assert "reward:jpeg-compressibility" in out


def test_train_without_progress_bar_ends_with_a_completion_line(tmp_path, monkeypatch, capsys):
    host = build_host(load_entrypoints=False, extra_plugins=(toy_components,))
    monkeypatch.setattr(cli, "get_host", lambda: host)
    recipe = tmp_path / "toy.yaml"
    recipe.write_text(yaml.safe_dump(toy_recipe(str(tmp_path / "run"), max_steps=2)))  # progress: false
    assert cli.main(["train", "--recipe", str(recipe)]) == 0
    err = capsys.readouterr().err
    assert "completed 2 step(s)" in err and str(tmp_path / "run") in err


def test_training_commands_silence_third_party_notices_and_bars(tmp_path, monkeypatch, capsys):
    for name in ("HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY", "RLPOST_VERBOSE"):
        monkeypatch.delenv(name, raising=False)
    logger = logging.getLogger("DeepSpeed")
    monkeypatch.setattr(logger, "filters", [])  # restored after the test
    host = build_host(load_entrypoints=False, extra_plugins=(toy_components,))
    monkeypatch.setattr(cli, "get_host", lambda: host)
    recipe = tmp_path / "toy.yaml"
    recipe.write_text(yaml.safe_dump(toy_recipe(str(tmp_path / "run"), max_steps=1)))
    assert cli.main(["train", "--recipe", str(recipe)]) == 0
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1" and os.environ["TRANSFORMERS_VERBOSITY"] == "error"
    warning = logging.LogRecord("DeepSpeed", logging.WARNING, __file__, 1, "Setting accelerator to CPU", None, None)
    error = logging.LogRecord("DeepSpeed", logging.ERROR, __file__, 1, "a real failure", None, None)
    assert not logger.filter(warning) and logger.filter(error)


def test_rlpost_verbose_keeps_third_party_output(monkeypatch):
    monkeypatch.setenv("RLPOST_VERBOSE", "1")
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    logger = logging.getLogger("DeepSpeed")
    monkeypatch.setattr(logger, "filters", [])
    cli._quiet_third_party()
    assert "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ and logger.filters == []


# ------------------------------------------------------------------ the jsonargparse command line


def _toy_cli(monkeypatch, tmp_path: Path) -> Path:
    """A toy recipe file, with ``rlpost`` resolving the toy components' registered names."""
    host = build_host(load_entrypoints=False, extra_plugins=(toy_components,))
    monkeypatch.setattr(cli, "get_host", lambda: host)
    recipe = tmp_path / "toy.yaml"
    recipe.write_text(yaml.safe_dump(toy_recipe(str(tmp_path / "run"))))  # sampler toy-chain, num_steps 3
    return recipe


def _printed(capsys, *args: str) -> dict:
    assert cli.main(["train", *args, "--print_config"]) == 0, capsys.readouterr().err
    return yaml.safe_load(capsys.readouterr().out)


def test_recipe_files_and_overrides_merge_in_command_line_order(monkeypatch, tmp_path, capsys):
    recipe = _toy_cli(monkeypatch, tmp_path)
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text("sampler:\n  init_args: {num_steps: 2}\n")
    # An option before a file is overlaid by that file; one after it wins (the old parser applied every option last).
    before = _printed(capsys, "--recipe", str(recipe), "--sampler.num_steps", "5", "--recipe", str(overlay))
    assert before["sampler"]["init_args"]["num_steps"] == 2
    after = _printed(capsys, "--recipe", str(recipe), "--recipe", str(overlay), "--sampler.init_args.num_steps", "5")
    assert after["sampler"]["init_args"]["num_steps"] == 5


def test_a_component_named_on_the_command_line_takes_options_after_it(monkeypatch, tmp_path, capsys):
    recipe = _toy_cli(monkeypatch, tmp_path)
    short = _printed(capsys, "--recipe", str(recipe), "--sampler", "toy-chain", "--sampler.num_steps", "4")
    assert short["sampler"] == {"class_path": "tests.toy_components.ToyChainSampler", "init_args": {"num_steps": 4}}
    by_class = _printed(capsys, "--recipe", str(recipe), "--sampler=ToyChainSampler", "--sampler.init_args.num_steps=4")
    assert by_class["sampler"] == short["sampler"]


def test_component_help_resolves_a_plugins_registered_name(monkeypatch, tmp_path, capsys):
    _toy_cli(monkeypatch, tmp_path)
    assert cli.main(["validate", "--sampler.help", "toy-chain"]) == 0
    assert "--sampler.num_steps NUM_STEPS" in capsys.readouterr().out


def test_unknown_command_line_option_names_it_and_the_nearest_field(monkeypatch, tmp_path, capsys):
    recipe = _toy_cli(monkeypatch, tmp_path)
    assert cli.main(["validate", "--recipe", str(recipe), "--samplr", "toy-chain"]) == 2
    assert "--samplr: unknown option; did you mean 'sampler'?" in capsys.readouterr().err
    assert cli.main(["validate", "--recipe", str(recipe), "--sampler.num_step", "2"]) == 2
    assert "sampler.init_args.num_step: unknown option; did you mean sampler.init_args.num_steps?" in (
        capsys.readouterr().err
    )


def test_command_line_values_keep_the_yaml_limits(monkeypatch, tmp_path, capsys):
    recipe = _toy_cli(monkeypatch, tmp_path)
    names = "abcdefg"
    levels = ["&a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    for prev, name in zip(names, names[1:], strict=False):  # 10**7 values once expanded
        levels.append(f"&{name} [" + ", ".join([f"*{prev}"] * 10) + "]")
    bomb = "[" + ", ".join(levels) + "]"
    assert cli.main(["validate", "--recipe", str(recipe), "--run.seed", bomb]) == 2
    assert "--run.seed: not valid YAML: aliases expand to more than" in capsys.readouterr().err


def test_a_run_saved_before_nested_defaults_were_listed_resumes(tmp_path):
    """The resolved recipe now lists nested defaults (``model.init_args.lora``) as jsonargparse fills them; a run
    saved without them is the same model."""
    from rlpost.apps.host import get_host
    from rlpost.engine.recipe import build_parser, parse_recipe_args, state_breaking_changes

    saved = {"class_path": "rlpost.models.sd3.SD3Policy", "init_args": {"pretrained": "tiny-random", "lora": {}}}
    saved["init_args"]["lora"] = {"rank": 4}
    recipe = tmp_path / "model.yaml"
    recipe.write_text(yaml.safe_dump({"model": saved}))
    cfg, _ = parse_recipe_args(build_parser(), ["--recipe", str(recipe)], get_host())
    assert "dropout" in cfg["model"]["init_args"]["lora"]  # the nested default was filled in
    assert state_breaking_changes({"model": saved}, cfg) == []
    cfg["model"]["init_args"]["lora"]["rank"] = 8
    assert state_breaking_changes({"model": saved}, cfg)


def test_component_help_for_list_fields_takes_one_components_name(capsys):
    assert cli.main(["train", "--rewards.help", "jpeg-compressibility"]) == 0
    assert "--rewards.quality" in capsys.readouterr().out
    assert cli.main(["train", "--eval.judges.help", "jpeg-compresibility"]) == 2
    assert "did you mean 'jpeg-compressibility'" in capsys.readouterr().err


def test_inline_yaml_components_on_the_command_line_resolve_registered_names(monkeypatch, tmp_path, capsys):
    recipe = _toy_cli(monkeypatch, tmp_path)
    printed = _printed(
        capsys,
        "--recipe",
        str(recipe),
        "--rewards",
        "[toy-brightness]",
        "--sampler={class_path: toy-chain, num_steps: 2}",
    )
    assert printed["rewards"] == [{"class_path": "tests.toy_components.ToyMeanReward"}]
    assert printed["sampler"]["init_args"]["num_steps"] == 2
    # An eval section given only on the command line is kept, so its missing prompt source is reported.
    assert cli.main(["validate", "--recipe", str(recipe), "--eval.judges", "[toy-brightness]"]) == 2
    assert "eval.prompts: missing" in capsys.readouterr().err
