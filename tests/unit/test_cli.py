"""The ``rlpost`` command line itself: version, help, component help, plugin listing."""

from __future__ import annotations

import importlib.metadata
import logging
import os
from pathlib import Path

import yaml

from rlpost.apps import cli
from rlpost.core.plugins import PluginHost
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
    host = PluginHost(load_entrypoints=False, extra_plugins=(toy_components,))
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
    host = PluginHost(load_entrypoints=False, extra_plugins=(toy_components,))
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
