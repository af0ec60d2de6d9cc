"""The recipe's one table of sections (``rlpost.engine.recipe.SECTIONS``) and the config classes' own range checks.

The table feeds validation, the command-line parser, name resolution and the resume checks; these tests keep the
places it cannot generate (the :class:`Recipe` dataclass) in step with it, and check that each config class reports
its problems relative to its section while the recipe names the full field.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from rlpost.apps import cli
from rlpost.apps.host import build_host, reset_host
from rlpost.engine import evaluation
from rlpost.engine.checkpoint import CheckpointConfig
from rlpost.engine.distributed_config import DistributedConfig
from rlpost.engine.ema import EMAConfig
from rlpost.engine.evaluation import EvalSettings
from rlpost.engine.guards import GuardConfig
from rlpost.engine.logging_ import LoggingConfig
from rlpost.engine.recipe import (
    EVAL_SECTIONS,
    SECTIONS,
    Recipe,
    RecipeError,
    RunConfig,
    build_parser,
    state_breaking_changes,
    validate,
)
from tests import toy_components
from tests.toy_components import toy_recipe


def test_recipe_dataclass_has_one_field_per_section():
    assert {f.name for f in dataclasses.fields(Recipe)} - {"config"} == {s.name for s in SECTIONS}


def test_eval_components_are_the_evaluation_packages():
    """The parser's ``eval`` components (``EVAL_SECTIONS``) are the keys the evaluation validator treats as such."""
    assert tuple(e.name for e in EVAL_SECTIONS) == evaluation.section.COMPONENTS


def test_parser_has_an_option_for_every_section():
    options = {key.split(".")[0] for key in build_parser().get_defaults().keys()}
    assert options == {s.name for s in SECTIONS} | {"recipe"}


def test_every_config_section_owns_a_problems_method():
    for section in SECTIONS:
        if section.kind == "config":
            assert section.type().problems() == [], section.name  # the defaults are sane


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (RunConfig(max_steps=0), "max_steps: must be >= 1, got 0"),
        (CheckpointConfig(keep_last=-1), "keep_last: must be >= 0, got -1"),
        (GuardConfig(max_skipped_steps=-2), "max_skipped_steps: must be >= 0, got -2"),
        (LoggingConfig(grid_every=-1), "grid_every: must be >= 0, got -1"),
        (EMAConfig(decay=1.0), "decay: must be in [0, 1), got 1.0"),
        (EMAConfig(update_every=0), "update_every: must be >= 1, got 0"),
        (EvalSettings(every=-1), "every: must be >= 0, got -1"),
        (EvalSettings(batch_size=0), "batch_size: must be >= 1, got 0"),
        (DistributedConfig(zero_stage=4), "zero_stage: must be 0, 1, 2 or 3, got 4"),
    ],
)
def test_config_problems_name_the_field_relative_to_the_section(config, expected):
    assert config.problems() == [expected]


def test_recipe_prefixes_each_config_problem_with_its_section(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    host = build_host(load_entrypoints=False, extra_plugins=(toy_components,))
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"gradient_accumulation_steps": 4}))
    cfg = toy_recipe(str(tmp_path / "r"), log_every=0)
    cfg["checkpoint"] = {"every": -1}
    cfg["guards"] = {"max_skipped_steps": -1}
    cfg["logging"] = {"grid_every": -3}
    cfg["ema"] = {"decay": 1.5, "update_every": 0}
    cfg["distributed"] = {"zero_stage": 9, "deepspeed_config": str(ds)}
    cfg["eval"] = {"prompts": cfg["prompts"], "num_steps": 0}
    with pytest.raises(RecipeError) as err:
        validate(cfg, host)
    for field in (
        "run.log_every: must be >= 1",
        "checkpoint.every: must be >= 0",
        "guards.max_skipped_steps: must be >= 0",
        "logging.grid_every: must be >= 0",
        "ema.decay: must be in [0, 1)",
        "ema.update_every: must be >= 1",
        "distributed.zero_stage: must be 0, 1, 2 or 3",
        "distributed.deepspeed_config: gradient_accumulation_steps must be 1 or absent",
        "eval.num_steps: must be >= 1",
    ):
        assert any(p.startswith(field) for p in err.value.problems), (field, err.value.problems)


def test_state_breaking_sections_come_from_the_table():
    old = {s.name: {"class_path": "a.A"} for s in SECTIONS if s.state}
    new = {**old, "sampler": {"class_path": "b.B"}, "prompts": {"class_path": "b.B"}}
    assert state_breaking_changes(old, new) == ["sampler.class_path: changed from 'a.A' to 'b.B'"]


# ------------------------------------------------------------------------------------ a section of the wrong shape


def _wrong_shapes(section) -> list:
    """Values ``section`` can never hold: a scalar and a container of the other kind (a string names a component or a
    factory, so it is wrong only where a mapping or a list is expected)."""
    if section.kind == "component-list":
        return [5, "abc", {"a": 1}]
    if section.kind in ("component", "factory"):
        return [5, [1, 2]]
    return [5, [1, 2], "abc"]


WRONG_SHAPES = [(s.name, value) for s in SECTIONS for value in _wrong_shapes(s)]


@pytest.mark.parametrize(("name", "value"), WRONG_SHAPES, ids=lambda v: repr(v))
def test_every_section_given_the_wrong_shape_is_a_problem_naming_it(name, value, tmp_path):
    host = build_host(load_entrypoints=False, extra_plugins=(toy_components,))
    cfg = toy_recipe(str(tmp_path / "r"))
    cfg[name] = value
    with pytest.raises(RecipeError) as err:
        validate(cfg, host)
    assert any(p.startswith(f"{name}: expected ") for p in err.value.problems), err.value.problems
    assert "functools" not in str(err.value) and "partial" not in str(err.value)


def test_nested_settings_and_init_args_of_the_wrong_shape_name_their_field(tmp_path):
    host = build_host(load_entrypoints=False, extra_plugins=(toy_components,))
    cfg = toy_recipe(str(tmp_path / "r"), speedups=5)
    cfg["sampler"] = {"class_path": "toy-chain", "init_args": [3]}
    cfg["eval"] = {"prompts": cfg["prompts"], "alarm": 5}
    with pytest.raises(RecipeError) as err:
        validate(cfg, host)
    problems = err.value.problems
    assert any(p.startswith("run.speedups: expected a mapping of its settings") for p in problems), problems
    assert any(p.startswith("sampler.init_args: expected a mapping of constructor arguments") for p in problems)
    assert "eval.alarm: expected a mapping of its settings, got a value of type int" in problems, problems
    assert "functools" not in str(err.value)


TINY_TREEGRPO = Path(__file__).resolve().parents[2] / "recipes" / "tiny" / "treegrpo.yaml"


@pytest.mark.parametrize("command", ["validate", "train"])
@pytest.mark.parametrize(("name", "value"), [(s.name, 5) for s in SECTIONS] + [("run", [1, 2]), ("eval", "abc")])
def test_a_section_given_a_scalar_in_an_overlay_is_refused(name, value, command, tmp_path, capsys):
    """jsonargparse dropped ``run: 5`` and ``eval: 5`` from an overlay (a run trained) and refused ``checkpoint: 5``
    with its instantiation internals; each is refused before it reads the file, naming the section and the file."""
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text(yaml.safe_dump({name: value}))
    out = tmp_path / "run"
    reset_host(None)
    try:
        rc = cli.main([command, "--recipe", str(TINY_TREEGRPO), "--recipe", str(overlay), "--run.output_dir", str(out)])
    finally:
        reset_host(None)
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2, err
    assert f"{name}: expected " in err and str(overlay) in err and "Traceback" not in err and "functools" not in err
    assert not out.exists()


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--run", "5"], "run: expected a mapping of its settings or a settings file, got '5'"),
        (["--checkpoint", "[1, 2]"], "checkpoint: expected a mapping of its settings or a settings file"),
        (["--run.speedups", "5"], "run.speedups: expected a mapping of its settings or a settings file"),
        (["--ema", "5"], "ema: expected a mapping of its settings or null, got '5'"),
        (["--eval", "5"], "--eval: set the section's fields one by one (--eval.FIELD VALUE) or in a recipe file"),
    ],
)
def test_a_section_given_a_scalar_on_the_command_line_is_refused(option, message, tmp_path, capsys):
    out = tmp_path / "run"
    reset_host(None)
    try:
        rc = cli.main(["validate", "--recipe", str(TINY_TREEGRPO), "--run.output_dir", str(out), *option])
    finally:
        reset_host(None)
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and message in err, err
    assert "Traceback" not in err and not out.exists()


def test_run_accelerate_is_a_deprecated_alias_of_run_speedups(tmp_path):
    host = build_host(load_entrypoints=False, extra_plugins=(toy_components,))
    cfg = toy_recipe(str(tmp_path / "r"), accelerate={"overlap_groups": 1})
    with pytest.warns(FutureWarning, match=r"run\.accelerate is deprecated; use run\.speedups"):
        recipe = validate(cfg, host)
    assert recipe.run.speedups.overlap_groups == 1 and recipe.run.accelerate is None
    assert "accelerate" not in recipe.config["run"] and recipe.config["run"]["speedups"]["overlap_groups"] == 1
    both = toy_recipe(str(tmp_path / "r"), accelerate={"overlap_groups": 1}, speedups={"overlap_groups": 2})
    with pytest.raises(RecipeError, match=r"run\.accelerate: the deprecated name of run\.speedups, given beside it"):
        validate(both, host)
