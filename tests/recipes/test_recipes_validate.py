"""Every YAML under recipes/ validates (torchtune's "every config validates"), without loading any model.

Overlays in recipes/ablations/ name their base recipe in a ``# base: recipes/...`` header line. Recipes whose prompt
sets come from the Hugging Face hub (the SD3.5 recipes: HPD v2 training and benchmark prompts) are validated with
small stand-in files of those datasets placed in a scratch hub cache, as ``hf_hub_download`` would have left them
(the recipe is valid given its data); prompt files a recipe names by a relative path the user provides (GenEval's
prompt files of recipes/dgpo_sd35.yaml) get a stand-in file at that path in the scratch directory; model weights and
reward checkpoints are stood in the same way (tests/weights_standins.py). CI runs offline (HF_HUB_OFFLINE=1), so the
hub data not being cached is also checked: validation then fails with exit 2, naming each prompt field and how to
provide it, and writes nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rlpost.apps import cli
from rlpost.apps.host import build_host
from rlpost.core.plugins import PluginHost
from rlpost.engine.recipe import RecipeError, merge_sources, validate
from rlpost.models.flux import FluxPolicy
from rlpost.models.sd3 import SD3Policy
from rlpost.models.wan import WanPolicy
from rlpost_qwenimage.policy import QwenImagePolicy
from tests.weights_standins import hub_dataset_standin, standin_weights  # noqa: F401 - fixture

ROOT = Path(__file__).resolve().parents[2]
# recipes/bench/ holds bench recipes (a ``bench`` section plus per-algorithm overlays), validated by
# tests/unit/test_bench.py through rlpost.bench instead.
ALL = sorted(p for p in (ROOT / "recipes").rglob("*.yaml") if "bench" not in p.relative_to(ROOT).parts)
OVERLAYS = [p for p in ALL if "ablations" in p.parts]
FULL = [p for p in ALL if p not in OVERLAYS]


@pytest.fixture(scope="module")
def host() -> PluginHost:
    return build_host()


@pytest.fixture(autouse=True)
def no_weights(monkeypatch):
    for policy in (SD3Policy, FluxPolicy, WanPolicy, QwenImagePolicy):
        monkeypatch.setattr(policy, "setup", lambda self, device: pytest.fail("validation loaded a model"))


def _hub_sources(*recipes: Path) -> list[tuple[str, str, list[str], str]]:
    """``(field, repo_id, data_files, column)`` of every hub-dataset prompt source (training and evaluation) the
    recipes name, read from their YAML."""
    found = []
    for recipe in recipes:
        cfg = yaml.safe_load(recipe.read_text()) or {}
        sources = {"prompts": cfg.get("prompts")}
        evaluation = cfg.get("eval") or {}
        sources.update({f"eval.sets.{k}": v for k, v in (evaluation.get("sets") or {}).items()})
        for field, source in sources.items():
            args = (source or {}).get("init_args") or {}
            if (source or {}).get("class_path") == "hf-dataset" and "/" in str(args.get("path", "")):
                files = args.get("data_files") or []
                files = [files] if isinstance(files, str) else list(files)
                found.append((field, args["path"], files, args.get("column", "prompt")))
    return found


SD35 = [p for p in FULL if _hub_sources(p)]


def _local_prompt_files(*recipes: Path) -> list[str]:
    """Relative paths of the prompt files (``prompt-file``, training and evaluation) the recipes name that the
    repository does not ship: data the user provides."""
    found = []
    for recipe in recipes:
        cfg = yaml.safe_load(recipe.read_text()) or {}
        sources = [cfg.get("prompts"), *((cfg.get("eval") or {}).get("sets") or {}).values()]
        for source in sources:
            path = str(((source or {}).get("init_args") or {}).get("path", ""))
            if (source or {}).get("class_path") == "prompt-file" and path and not Path(path).is_absolute():
                if not (ROOT / path).exists():
                    found.append(path)
    return found


@pytest.fixture
def scratch(tmp_path, monkeypatch, standin_weights):  # noqa: F811 - the fixture imported above
    """Run validation from a scratch working directory, with stand-ins of the model weights and reward checkpoints
    the recipes name (validation checks they are installed; nothing loads them). Calling the fixture's value with
    recipes also places stand-ins of their hub prompt datasets in the scratch hub cache."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "assets").symlink_to(ROOT / "assets")  # shipped models (assets/digits-sd3) resolve as in the repo

    def provide(*recipes: Path) -> None:
        for _, repo_id, files, column in _hub_sources(*recipes):
            records = json.dumps([{column: "a photo of a cat"}, {column: "a watercolor painting of a lighthouse"}])
            hub_dataset_standin(standin_weights / "hub", repo_id, dict.fromkeys(files, records))
        for path in _local_prompt_files(*recipes):
            (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / path).write_text('{"prompt": "a photo of a cat", "tag": "single_object"}\n')

    return provide


def _base_of(overlay: Path) -> Path:
    for line in overlay.read_text().splitlines():
        if line.startswith("# base:"):
            return ROOT / line.split(":", 1)[1].strip()
    raise AssertionError(f"{overlay.relative_to(ROOT)} has no '# base: recipes/...' header")


def test_recipes_exist():
    assert FULL and OVERLAYS


@pytest.mark.parametrize("recipe", FULL, ids=lambda p: str(p.relative_to(ROOT)))
def test_recipe_validates(recipe, host, scratch):
    scratch(recipe)
    validate(merge_sources([str(recipe)]), host)


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: str(p.relative_to(ROOT)))
def test_overlay_validates_on_its_base(overlay, host, scratch):
    base = _base_of(overlay)
    scratch(base, overlay)
    merged = merge_sources([str(base), str(overlay)])
    recipe = validate(merged, host)
    plain = validate(merge_sources([str(base)]), host)
    assert recipe.config != plain.config, f"{overlay.name} changes nothing"


def test_sd35_recipes_name_hub_prompt_sets():
    """The headline commands work as typed: every SD3.5 recipe names hub datasets for its training prompts (and its
    evaluation prompts, where it evaluates), not local files a user would have to pass with --prompts.path."""
    assert {p.name for p in SD35} >= {
        "treegrpo_sd35.yaml",
        "treegrpo_code_sd35.yaml",
        "dancegrpo_sd35.yaml",
        "mixgrpo_sd35.yaml",
        "ddpo_sd35.yaml",
    }
    for recipe in SD35:
        fields = {field for field, *_ in _hub_sources(recipe)}
        assert "prompts" in fields, recipe.name
        assert "--prompts.path" not in recipe.read_text().split("\n# Prompts:")[0], f"{recipe.name} usage lines"


@pytest.mark.parametrize("recipe", SD35, ids=lambda p: p.name)
def test_sd35_recipe_offline_without_prompt_cache_says_how(recipe, host, scratch, monkeypatch):
    """Offline with the weights installed but the hub prompt sets not cached, the only problems are the prompt
    fields', each saying what is missing and how to provide it."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RecipeError) as info:
        validate(merge_sources([str(recipe)]), host)
    problems = info.value.problems
    expected = {field for field, *_ in _hub_sources(recipe)}
    assert {p.split(".init_args")[0] for p in problems} == expected, problems
    for problem in problems:
        assert "is not in the local Hugging Face cache" in problem and "offline mode is on" in problem
        assert "run once with network access" not in problem  # offline is the rule (README): say the command
        assert "fetch it with `hf download " in problem and "--repo-type dataset`" in problem
        field = problem.split(".init_args")[0]
        assert f"--{field}.path FILE" in problem  # the flag that replaces this very source


@pytest.mark.parametrize("command", ["validate", "train"])
def test_headline_command_offline_exits_2_and_writes_nothing(command, scratch, monkeypatch, capsys, tmp_path):
    """`rlpost validate|train --recipe recipes/treegrpo_sd35.yaml` offline, prompts not cached: exit 2 with the
    fields named, before any model loads (SD3Policy.setup fails the test) and without writing anything."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("RLPOST_VERBOSE", "1")  # train would otherwise set progress-bar variables for later tests
    before = sorted(tmp_path.rglob("*"))
    assert cli.main([command, "--recipe", str(ROOT / "recipes" / "treegrpo_sd35.yaml")]) == 2
    err = capsys.readouterr().err
    assert "prompts.init_args.data_files: train.json of dataset 'ymhao/HPDv2' is not in the local" in err
    assert "eval.sets.hpdv2.init_args.data_files:" in err and "--eval.sets.hpdv2.path FILE" in err
    assert sorted(tmp_path.rglob("*")) == before  # no run directory, no cache entries


def test_headline_command_validates_once_prompts_are_cached(scratch, monkeypatch, capsys):
    """With the HPD v2 files in the (stand-in) hub cache, offline, the headline command validates with no flag."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    recipe = ROOT / "recipes" / "treegrpo_sd35.yaml"
    scratch(recipe)
    assert cli.main(["validate", "--recipe", str(recipe)]) == 0, capsys.readouterr().err


WAN = [ROOT / "recipes" / "treegrpo_wan21_1.3b.yaml", ROOT / "recipes" / "dancegrpo_wan21_1.3b.yaml"]


@pytest.mark.parametrize("recipe", WAN, ids=lambda p: p.name)
def test_wan_recipes_say_what_they_need_and_check_the_released_geometry(recipe, host, scratch):
    """The Wan2.1 production recipes validate against the Wan2.1-T2V-1.3B stand-in (released configs, UniPC
    scheduler) as 33-frame videos; their headers give the 8-GPU command and every file they need; a frame count or
    size the released VAE and patch cannot take is a problem naming the field."""
    scratch(recipe)
    cfg = merge_sources([str(recipe)])
    validated = validate(cfg, host)
    assert validated.model.frames == 33 and validated.model.pretrained == "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    header = recipe.read_text().split("\nrun:")[0]
    for needed in (
        f"deepspeed --num_gpus 8 --module rlpost.apps.cli train --recipe recipes/{recipe.name}",
        f"rlpost download --recipe recipes/{recipe.name}",
        "--model.pretrained",
        "$RLPOST_MODELS/HPS_v2.1_compressed.pt",
        "ImageReward.pt",
        "DFN5B-CLIP-ViT-H-14-384",
        "ymhao/HPDv2",
        "zhwang/HPDv2",
    ):
        assert needed in header, (recipe.name, needed)
    bad = json.loads(json.dumps(cfg))
    bad["model"]["init_args"].update(num_frames=32, height=470)
    with pytest.raises(RecipeError) as info:
        validate(bad, host)
    assert {p.split(":")[0] for p in info.value.problems} == {"model.init_args.num_frames", "model.init_args.height"}


def test_qwenimage_recipe_checks_resolution_against_the_cached_vae(scratch, monkeypatch, capsys):
    """recipes/treegrpo_qwenimage.yaml reads the VAE factor from the cached Qwen/Qwen-Image snapshot's config (8, x2
    for the 2x2 packing): 520 px is refused naming the field, exit 2, before any weight loads."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    recipe = ROOT / "recipes" / "treegrpo_qwenimage.yaml"
    scratch(recipe)
    assert cli.main(["validate", "--recipe", str(recipe), "--model.resolution", "520"]) == 2
    assert "model.init_args.resolution: 520 is not a multiple of 16" in capsys.readouterr().err
    assert cli.main(["validate", "--recipe", str(recipe), "--model.resolution", "1328"]) == 0, capsys.readouterr().err
