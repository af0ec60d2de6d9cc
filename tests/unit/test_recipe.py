"""Recipe merging, overrides and validation: every malformed fixture fails with a message naming the field,
before any model is loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlpost.apps import cli
from rlpost.apps.host import build_host, get_host, reset_host
from rlpost.engine.recipe import RecipeError, merge_sources, parse_recipe, validate
from rlpost.models.sd3 import SD3Policy
from tests import toy_components
from tests.toy_components import toy_recipe
from tests.weights_standins import standin_weights  # noqa: F401 - fixture

ROOT = Path(__file__).resolve().parents[2]
RECIPES = Path(__file__).resolve().parents[1] / "fixtures" / "recipes"
BAD = sorted((RECIPES / "bad").glob("*.yaml"))
STANDALONE = [RECIPES / n for n in ("missing_model.yaml", "invalid_yaml.yaml", "not_a_mapping.yaml")]


def _expectations(path: Path) -> list[str]:
    return [line.split("expect:", 1)[1].strip() for line in path.read_text().splitlines() if "# expect:" in line]


@pytest.fixture(autouse=True)
def no_model_loading(monkeypatch, standin_weights):  # noqa: F811 - the fixture imported above
    # valid.yaml names SD3.5 Medium and fixtures name prompt files by repository-relative paths: validate them from
    # the repository root with a stand-in of the model in a scratch HF cache.
    monkeypatch.chdir(ROOT)

    def forbidden(self, device):
        raise AssertionError("validation must not load any model")

    monkeypatch.setattr(SD3Policy, "setup", forbidden)
    reset_host(None)
    yield
    reset_host(None)


def test_there_are_at_least_15_malformed_fixtures():
    assert len(BAD) + len(STANDALONE) >= 15


def test_valid_fixture_validates(capsys):
    assert cli.main(["validate", "--recipe", str(RECIPES / "valid.yaml")]) == 0
    err = capsys.readouterr().err
    assert "recipe OK" in err
    assert "samples per step" in err and "54" in err  # 2 groups x 27 leaves
    assert "trainable edges per step" in err and "78" in err  # 2 x (3 + 9 + 27)


@pytest.mark.parametrize("overlay", BAD, ids=lambda p: p.stem)
def test_malformed_overlay_is_rejected_naming_the_field(overlay, capsys):
    rc = cli.main(["validate", "--recipe", str(RECIPES / "valid.yaml"), "--recipe", str(overlay)])
    err = capsys.readouterr().err
    assert rc == 2, err
    expected = _expectations(overlay)
    assert expected, f"{overlay.name} has no '# expect:' line"
    flat = " ".join(err.split())
    for text in expected:
        assert " ".join(text.split()) in flat, f"{overlay.name}: {text!r} not in:\n{err}"


@pytest.mark.parametrize("recipe", STANDALONE, ids=lambda p: p.stem)
def test_malformed_standalone_recipe_is_rejected(recipe, capsys):
    rc = cli.main(["validate", "--recipe", str(recipe)])
    err = capsys.readouterr().err
    assert rc == 2
    for text in _expectations(recipe):
        assert text in err


def test_missing_recipe_file(capsys):
    assert cli.main(["validate", "--recipe", "nope.yaml"]) == 2
    assert "recipe file not found: nope.yaml" in capsys.readouterr().err


def test_overlay_swapping_a_component_drops_the_old_arguments(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("sampler:\n  class_path: tree\n  init_args: {k: 4}\n")
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text("sampler:\n  class_path: dance\n")
    cfg = merge_sources([str(base), str(overlay)])
    assert cfg["sampler"] == {"class_path": "dance"}


def test_cli_overrides_parse_yaml_values_and_target_init_args():
    overrides = [("sampler.k", "4"), ("run.max_steps", "7"), ("optimizer", "clipped-surrogate")]
    cfg = parse_recipe([str(RECIPES / "valid.yaml")], overrides, get_host())
    assert cfg["sampler"]["init_args"]["k"] == 4
    assert cfg["run"]["max_steps"] == 7
    assert cfg["optimizer"]["class_path"] == "rlpost.components.clipped_surrogate.ClippedSurrogate"


def test_components_resolve_by_name_class_name_or_class_path(tmp_path):
    host = build_host(load_entrypoints=False, extra_plugins=(toy_components,))
    for ref in ("toy-chain", "ToyChainSampler", "tests.toy_components.ToyChainSampler"):
        cfg = toy_recipe(str(tmp_path))
        cfg["sampler"] = {"class_path": ref, "num_steps": 2}  # flat shorthand for init_args
        recipe = validate(cfg, host)
        assert isinstance(recipe.sampler, toy_components.ToyChainSampler) and recipe.sampler.num_steps == 2


def test_all_problems_are_reported_at_once(tmp_path):
    host = build_host(load_entrypoints=False, extra_plugins=(toy_components,))
    cfg = toy_recipe(str(tmp_path))
    cfg["advantage"] = "toy-tree-only"
    cfg["run"]["groups_per_step"] = 0
    cfg["reward_weights"] = {"toy-brightness": -1}
    with pytest.raises(RecipeError) as err:
        validate(cfg, host)
    text = str(err.value)
    assert "reward_weights.toy-brightness: negative weight" in text
    assert "run.groups_per_step: must be >= 1" in text
    assert "'toy-tree-only' requires the capability 'tree'" in text


def test_print_config_shows_the_resolved_recipe(capsys):
    assert cli.main(["train", "--recipe", str(RECIPES / "valid.yaml"), "--print_config"]) == 0
    out = capsys.readouterr().out
    assert "class_path: rlpost_treegrpo." in out and "reward_weights:" in out


def test_train_help_lists_options_from_docstrings(capsys):
    assert cli.main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--run.max_steps" in out and "--sampler" in out


def test_unknown_nested_option_names_its_field_path_and_the_nearest_name(capsys):
    rc = cli.main(
        [
            "validate",
            "--recipe",
            str(RECIPES / "valid.yaml"),
            "--sampler.kk",
            "3",
            "--torch_optimizer.init_args.lrr",
            "0.1",
            "--ema.decy",
            "0.5",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert "sampler.init_args.kk: unknown option; did you mean sampler.init_args.k?" in err
    assert "torch_optimizer.init_args.lrr: unknown option; did you mean torch_optimizer.init_args.lr?" in err
    assert "ema.decy: unknown option; did you mean ema.decay?" in err


def test_unknown_reward_option_with_no_close_name_lists_the_options(tmp_path):
    host = build_host(load_entrypoints=False, extra_plugins=(toy_components,))
    cfg = toy_recipe(str(tmp_path))
    cfg["rewards"] = [{"class_path": "toy-brightness", "init_args": {"zzzzzz": 1}}]
    with pytest.raises(RecipeError) as err:
        validate(cfg, host)
    assert "rewards[0].init_args.zzzzzz: unknown option (options: " in str(err.value)


def test_print_config_lists_every_component_default_and_validates_again(capsys, tmp_path):
    assert cli.main(["train", "--recipe", str(RECIPES / "valid.yaml"), "--print_config"]) == 0
    printed = capsys.readouterr().out
    config = yaml.safe_load(printed)
    optimizer_args = config["optimizer"]["init_args"]
    for name in ("adv_clip_max", "kl_coef", "inner_epochs"):
        assert name in optimizer_args, name
    assert "k" in config["sampler"]["init_args"]
    # The printed recipe is itself a valid recipe that prints the same.
    (tmp_path / "printed.yaml").write_text(printed)
    assert cli.main(["train", "--recipe", str(tmp_path / "printed.yaml"), "--print_config"]) == 0
    assert capsys.readouterr().out == printed


def test_a_run_saved_without_defaults_resumes_under_a_recipe_listing_them():
    from rlpost.engine.recipe import state_breaking_changes, with_defaults

    bare = {"model": {"class_path": "rlpost.models.sd3.SD3Policy", "init_args": {"pretrained": "tiny-random"}}}
    full = {"model": with_defaults(bare["model"])}
    assert full["model"]["init_args"]["full_finetune"] is False  # the defaults were filled in
    assert state_breaking_changes(bare, full) == []
    changed = {"model": with_defaults({**bare["model"], "init_args": {"pretrained": "x"}})}
    assert state_breaking_changes(bare, changed)
