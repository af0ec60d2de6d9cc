"""``rlpost recipes list`` / ``rlpost recipes copy NAME DEST`` (rlpost.apps.recipes_cmd): the shipped recipes, found
in the source checkout and inside an installed wheel."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from rlpost.apps import cli
from rlpost.apps.recipes_cmd import list_recipes, recipes_root

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p for p in (ROOT / "recipes").rglob("*") if p.suffix in (".yaml", ".json"))


def _listed(capsys) -> list[dict]:
    assert cli.main(["recipes", "list", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_checkout_reads_its_own_recipes_folder():
    assert Path(str(recipes_root())) == ROOT / "recipes"  # no rlpost/_recipes outside a wheel


def test_list_json_names_every_shipped_recipe_with_kind_description_and_base(capsys):
    entries = _listed(capsys)
    expected = [str(p.relative_to(ROOT / "recipes")).removesuffix(".yaml") for p in SHIPPED]
    assert sorted(e["name"] for e in entries) == sorted(expected)
    by_name = {e["name"]: e for e in entries}
    # Grouped by folder: the top-level recipes first, then each folder's.
    folders = [e["folder"] for e in entries]
    assert folders == sorted(folders, key=lambda f: (f != "", f)) and folders[0] == ""
    assert by_name["tiny/treegrpo"] == {
        "name": "tiny/treegrpo",
        "folder": "tiny",
        "kind": "recipe",
        "description": "TreeGRPO on the tiny random SD3 (CPU smoke run / end-to-end test; not a quality run).",
        "base": None,
    }
    leaf = by_name["ablations/treegrpo_leaf_zscore"]
    assert leaf["kind"] == "overlay" and leaf["base"] == "recipes/treegrpo_sd35.yaml"
    assert leaf["description"] == (
        "Ablation: tree sampler + plain per-prompt leaf z-scores, no probability-weighted backup."
    )
    assert by_name["bench/digits"]["kind"] == "bench"
    assert by_name["deepspeed/zero2.json"]["kind"] == "json"
    for entry in entries:  # one line each, from the header comment
        assert entry["description"] and "\n" not in entry["description"] and len(entry["description"]) <= 110


def test_list_table_is_grouped_by_folder_and_not_truncated_when_piped(capsys):
    assert cli.main(["recipes", "list"]) == 0
    out = capsys.readouterr().out
    titles = [line.strip() for line in out.splitlines() if line.strip().startswith("recipes/")]
    assert titles[:3] == ["recipes/", "recipes/ablations/", "recipes/bench/"] and "recipes/tiny/" in titles
    assert "ablations/treegrpo_progressive_window" in out and "recipes/treegrpo_sd35.yaml" in out


def test_copy_writes_the_recipe_and_never_overwrites_without_force(tmp_path, capsys):
    source = (ROOT / "recipes" / "tiny" / "treegrpo.yaml").read_bytes()
    assert cli.main(["recipes", "copy", "tiny/treegrpo", str(tmp_path / "mine.yaml")]) == 0
    assert (tmp_path / "mine.yaml").read_bytes() == source
    # An existing destination is kept as it is unless --force.
    (tmp_path / "mine.yaml").write_text("my edits\n")
    assert cli.main(["recipes", "copy", "tiny/treegrpo", str(tmp_path / "mine.yaml")]) == 2
    assert "exists" in capsys.readouterr().err and (tmp_path / "mine.yaml").read_text() == "my edits\n"
    assert cli.main(["recipes", "copy", "tiny/treegrpo", str(tmp_path / "mine.yaml"), "--force"]) == 0
    assert (tmp_path / "mine.yaml").read_bytes() == source
    # Into an existing directory under the recipe's file name; a destination without a suffix gets the recipe's;
    # the name may carry .yaml and a recipes/ prefix; missing parent folders are made.
    assert cli.main(["recipes", "copy", "recipes/ablations/treegrpo_r07.yaml", str(tmp_path)]) == 0
    r07 = (ROOT / "recipes" / "ablations" / "treegrpo_r07.yaml").read_bytes()
    assert (tmp_path / "treegrpo_r07.yaml").read_bytes() == r07
    assert cli.main(["recipes", "copy", "deepspeed/zero2.json", str(tmp_path / "ds" / "zero")]) == 0
    assert json.loads((tmp_path / "ds" / "zero.json").read_text())["zero_optimization"]["stage"] == 2
    # The copy is a recipe that validates like the shipped one.
    assert yaml.safe_load((tmp_path / "mine.yaml").read_text())["sampler"]["class_path"] == "tree"


def test_copy_of_an_unknown_name_suggests_the_nearest(tmp_path, capsys):
    assert cli.main(["recipes", "copy", "ablations/treegrpo_r3", str(tmp_path / "x.yaml")]) == 2
    err = capsys.readouterr().err
    assert "unknown recipe 'ablations/treegrpo_r3'; did you mean 'ablations/treegrpo_r03'" in err
    assert cli.main(["recipes", "copy", "treegrpo", str(tmp_path / "x.yaml")]) == 2
    assert "'tiny/treegrpo'" in capsys.readouterr().err  # a bare file name points to its folder's recipe
    assert not (tmp_path / "x.yaml").exists()


def test_an_installed_wheel_carries_the_recipes(tmp_path):
    """The wheel holds recipes/ as rlpost/_recipes (hatch force-include), found through importlib.resources by an
    rlpost imported from the unpacked wheel, with no source checkout beside it."""
    pytest.importorskip("hatchling")
    from hatchling.builders.wheel import WheelBuilder

    (wheel,) = WheelBuilder(str(ROOT)).build(directory=str(tmp_path / "dist"), versions=["standard"])
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        packaged = sorted(n.removeprefix("rlpost/_recipes/") for n in archive.namelist() if "/_recipes/" in n)
        archive.extractall(site)
    assert packaged == sorted(str(p.relative_to(ROOT / "recipes")) for p in SHIPPED)
    probe = (
        "import json, rlpost\n"
        "from rlpost.apps.recipes_cmd import list_recipes, recipes_root\n"
        "print(json.dumps([rlpost.__file__, str(recipes_root()), [e.name for e in list_recipes()]]))\n"
    )
    env = {"PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    # From an empty directory: `python -c` puts the working directory (here the checkout) first on sys.path.
    run = {"env": env, "cwd": tmp_path, "capture_output": True, "text": True, "timeout": 300}
    done = subprocess.run([sys.executable, "-c", probe], **run)
    assert done.returncode == 0, done.stderr
    module, root, names = json.loads(done.stdout)
    assert Path(module).is_relative_to(site) and Path(root) == site / "rlpost" / "_recipes"
    assert names == [e.name for e in list_recipes()]
