"""Recipes that run from anywhere (relative paths resolve against the recipe file, then rlpost's shipped ``assets/``
and ``recipes/``; rlpost/core/shipped.py) and ``rlpost download`` (every Hub file a recipe's components declare, as
``hf download`` commands or fetched into the Hugging Face cache, after which the recipe validates offline)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml

from rlpost.apps import cli
from rlpost.apps.download import recipe_hub_files
from rlpost.apps.host import build_host
from rlpost.apps.recipes_cmd import copy_recipe
from rlpost.core.api import HubFiles
from rlpost.engine.recipe import parse_recipe
from rlpost.models.flux import FluxPolicy
from rlpost.models.sd3 import SD3Policy
from rlpost.models.wan import WanPolicy
from rlpost_qwenimage.policy import QwenImagePolicy
from tests.weights_standins import (
    hub_cache_standin,
    write_flux_standin,
    write_qwenimage_standin,
    write_sd3_standin,
    write_wan_standin,
)

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "assets" / "digits-sd3"
# The production recipes that name Hub ids (the digits recipes need nothing from the Hub).
PRODUCTION = sorted(p for p in (ROOT / "recipes").glob("*.yaml") if "digits" not in p.name)
# Cheap overrides of the README's main job: two steps of a small tree, no periodic evaluation.
CHEAP = [
    "--run.max_steps", "2", "--run.progress", "false", "--run.groups_per_step", "1", "--sampler.num_steps", "4",
    "--sampler.k", "2", "--sampler.depth", "2", "--optimizer.minibatch_edges", "8", "--eval.every", "0",
    "--eval.num_steps", "2",
]  # fmt: skip


@pytest.fixture(scope="module")
def host():
    return build_host()


@pytest.fixture
def elsewhere(tmp_path, monkeypatch) -> Path:
    """A working directory outside the checkout, with nothing in it."""
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


def test_main_recipe_paths_resolve_from_outside_the_checkout(elsewhere, host):
    """`recipes/treegrpo_digits.yaml` and its `assets/digits-sd3` name the shipped files from any directory (before:
    the recipe was not found, then the model folder was looked up as a Hub id)."""
    cfg = parse_recipe(["recipes/treegrpo_digits.yaml"], [], host)
    assert Path(cfg["model"]["init_args"]["pretrained"]) == DIGITS.resolve()
    assert cfg["run"]["output_dir"] == "runs/treegrpo-digits"  # outputs stay where the run starts
    assert cfg["sampler"]["init_args"]["window"] == "geometric"  # bare words are never paths


def test_a_path_next_to_the_recipe_wins(elsewhere, host, tmp_path):
    """A relative path that exists next to the recipe file is that file, wherever the command runs."""
    home = tmp_path / "project"
    (home / "models").mkdir(parents=True)
    (home / "models" / "digits").symlink_to(DIGITS)
    recipe = copy_recipe("treegrpo_digits", home / "mine.yaml")
    text = recipe.read_text().replace("pretrained: assets/digits-sd3", "pretrained: models/digits")
    recipe.write_text(text)
    cfg = parse_recipe([str(recipe)], [], host)
    assert cfg["model"]["init_args"]["pretrained"] == str((home / "models" / "digits").resolve())


def test_copied_recipe_and_overlay_validate_from_a_new_place(elsewhere, capsys):
    """`rlpost recipes copy` leaves a recipe that validates from its new place, with a shipped overlay on top."""
    assert cli.main(["recipes", "copy", "treegrpo_digits", "copy/my.yaml"]) == 0
    code = cli.main(["validate", "--recipe", "copy/my.yaml", "--recipe", "recipes/ablations/lr_decay_to_end.yaml"])
    assert code == 0, capsys.readouterr().err


def test_bench_recipe_resolves_its_base_from_outside_the_checkout(elsewhere):
    from rlpost.bench import load_bench

    spec = load_bench("recipes/bench/tiny.yaml")
    assert spec.base and all(Path(b).is_file() for b in spec.base)
    assert all(Path(r).is_file() for a in spec.algorithms for r in a.recipes)


def test_a_missing_shipped_folder_is_not_called_a_hub_id(elsewhere, host, capsys):
    """A missing `assets/...` folder is reported as a missing directory with the lookup rule, not as a Hub id
    missing from the cache with a download command."""
    assert cli.main(["validate", "--recipe", "recipes/treegrpo_digits.yaml", "--model.pretrained", "assets/nope"]) == 2
    err = capsys.readouterr().err
    assert "model directory 'assets/nope' does not exist" in err and "shipped assets/" in err
    assert "Hugging Face cache" not in err and "download" not in err


@pytest.mark.slow
def test_main_recipe_trains_from_outside_the_checkout(elsewhere, capsys):
    """The README's main job (two cheap steps) from a directory outside the checkout."""
    args = ["train", "--recipe", "recipes/treegrpo_digits.yaml", "--run.output_dir", "run", *CHEAP]
    assert cli.main(args) == 0, capsys.readouterr().err
    assert (elsewhere / "run" / "checkpoints" / "step_000002").is_dir()


# ------------------------------------------------------------------------------------------------ rlpost download


def test_hub_files_command_is_the_hf_cli():
    files = HubFiles("owner/name", ("a.pt", "b.json"))
    assert files.command() == "hf download owner/name a.pt b.json"
    pattern = HubFiles("o/n", ("model_index.json", "vae/*"), repo_type="dataset", revision="v1")
    assert shlex.split(pattern.command("/c")) == [
        "hf", "download", "o/n", "--include", "model_index.json", "--include", "vae/*",
        "--repo-type", "dataset", "--revision", "v1", "--cache-dir", "/c",
    ]  # fmt: skip


def test_digits_recipe_needs_nothing(capsys):
    assert cli.main(["download", "--dry-run", "--recipe", str(ROOT / "recipes" / "treegrpo_digits.yaml")]) == 0
    assert "nothing to download" in capsys.readouterr().out


_STANDINS = {SD3Policy: write_sd3_standin, FluxPolicy: write_flux_standin, WanPolicy: write_wan_standin}
_STANDINS[QwenImagePolicy] = write_qwenimage_standin


def _lay_out(cache: Path, files: HubFiles, model_class: type | None) -> None:
    """A stand-in of ``files`` in the Hugging Face cache layout: a pipeline stand-in for a base model, empty files
    (a JSON prompt list for datasets) for named files, the snapshot folder for patterns."""
    if "model_index.json" in files.patterns:
        assert model_class is not None
        hub_cache_standin(cache, files.repo_id, _STANDINS[model_class])
        return
    from huggingface_hub.file_download import repo_folder_name

    repo = cache / repo_folder_name(repo_id=files.repo_id, repo_type=files.repo_type)
    commit = "2" * 40
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / (files.revision or "main")).write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for name in files.patterns:
        if any(c in name for c in "*?["):
            continue
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps([{"prompt": "a photo of a cat"}]) if files.repo_type == "dataset" else ""
        (snapshot / name).write_text(text)


@pytest.mark.parametrize("recipe", PRODUCTION, ids=lambda p: p.name)
def test_dry_run_lists_every_file_and_the_recipe_then_validates_offline(
    recipe, host, tmp_path, monkeypatch, capsys, elsewhere
):
    """`rlpost download --dry-run` prints one `hf download` command per repository the recipe needs (gated ones
    with how to get access); a Hugging Face cache laid out as those commands leave it (tiny stand-ins) makes
    `rlpost validate` pass offline, with no $RLPOST_MODELS."""
    import huggingface_hub.constants

    from tests.recipes.test_recipes_validate import _local_prompt_files

    monkeypatch.delenv("RLPOST_MODELS", raising=False)
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    for path in _local_prompt_files(recipe):  # prompt files the user provides (GenEval's): not Hub files
        (elsewhere / path).parent.mkdir(parents=True, exist_ok=True)
        (elsewhere / path).write_text('{"prompt": "a photo of a cat", "tag": "single_object"}\n')
    needed = recipe_hub_files(["--recipe", str(recipe)], host)
    assert any("model_index.json" in f.patterns for f in needed), "the base model"
    assert cli.main(["validate", "--recipe", str(recipe)]) == 2  # nothing cached yet
    capsys.readouterr()
    assert cli.main(["download", "--dry-run", "--recipe", str(recipe)]) == 0
    script = capsys.readouterr().out
    commands = [line for line in script.splitlines() if line.startswith("hf download ")]
    assert commands == [f.command() for f in needed]
    for files in needed:
        if files.gated:
            assert f"# gated: accept its licence at https://huggingface.co/{files.repo_id}" in script
            assert "hf auth login" in script
    model = yaml.safe_load(recipe.read_text())["model"]["class_path"]
    model_class = {"sd3": SD3Policy, "flux": FluxPolicy, "wan": WanPolicy, "qwen-image": QwenImagePolicy}[model]
    for files in needed:
        _lay_out(cache, files, model_class)
    for policy in _STANDINS:
        monkeypatch.setattr(policy, "setup", lambda self, device: pytest.fail("validation loaded a model"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli.main(["validate", "--recipe", str(recipe)]) == 0, capsys.readouterr().err


def test_gated_models_are_declared_gated(host):
    gated = (("stabilityai/stable-diffusion-3.5-medium", SD3Policy), ("black-forest-labs/FLUX.1-dev", FluxPolicy))
    for repo, cls in gated:
        [files] = cls(pretrained=repo, resolution=512).hub_files()
        assert files.gated and "hf auth login" in files.access_hint()


def test_validate_hint_gives_the_hf_command(host, capsys, tmp_path, monkeypatch):
    """The missing-model hint names `hf download` (the pinned huggingface_hub's CLI), never `huggingface-cli`."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert cli.main(["validate", "--recipe", str(ROOT / "recipes" / "treegrpo_flux.yaml")]) == 2
    err = capsys.readouterr().err
    assert "huggingface-cli" not in err
    assert "`hf download black-forest-labs/FLUX.1-dev --include model_index.json" in err
    assert "FLUX.1-dev is gated" in err and "hf auth login" in err
    assert "`hf download xswu/HPSv2 HPS_v2.1_compressed.pt`" in err


def test_download_fetches_through_snapshot_download(host, monkeypatch, capsys, tmp_path):
    """Without --dry-run each repository goes through huggingface_hub.snapshot_download with its patterns; a gated
    one that refuses says how to get access, and the exit status says that something failed."""
    import huggingface_hub
    import huggingface_hub.constants
    from huggingface_hub.errors import GatedRepoError

    calls = []

    def fake(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        if repo_id.startswith("stabilityai/"):
            raise GatedRepoError.__new__(GatedRepoError, "401 gated")  # the real one needs an HTTP response
        return str(tmp_path / repo_id)

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    recipe = str(ROOT / "recipes" / "treegrpo_sd35.yaml")
    assert cli.main(["download", "--recipe", recipe, "--dir", str(tmp_path / "c")]) == 1
    err = capsys.readouterr().err
    assert "stabilityai/stable-diffusion-3.5-medium is gated: accept its licence" in err
    needed = recipe_hub_files(["--recipe", recipe], host)
    assert [c[0] for c in calls] == [f.repo_id for f in needed]
    for (_, kwargs), files in zip(calls, needed, strict=True):
        assert kwargs["allow_patterns"] == (list(files.patterns) or None)
        assert kwargs["cache_dir"] == str(tmp_path / "c") and kwargs["repo_type"] == files.repo_type
