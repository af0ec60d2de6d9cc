"""Every YAML under recipes/ validates (torchtune's "every config validates"), without loading any model.

Overlays in recipes/ablations/ name their base recipe in a ``# base: recipes/...`` header line. Recipes whose data
is not shipped (e.g. the HPDv2 training prompts) declare it with ``# requires-data: PATH``; the test validates them
in a scratch directory where a small stand-in file exists at that path (the recipe is valid given its data). Model
weights and reward checkpoints are stood in the same way (tests/weights_standins.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rlpost.core.plugins import PluginHost
from rlpost.engine.recipe import merge_sources, validate
from rlpost.models.sd3 import SD3Policy
from tests.weights_standins import standin_weights  # noqa: F401 - fixture

ROOT = Path(__file__).resolve().parents[2]
# recipes/bench/ holds bench recipes (a ``bench`` section plus per-algorithm overlays), validated by
# tests/unit/test_bench.py through rlpost.bench instead.
ALL = sorted(p for p in (ROOT / "recipes").rglob("*.yaml") if "bench" not in p.relative_to(ROOT).parts)
OVERLAYS = [p for p in ALL if "ablations" in p.parts]
FULL = [p for p in ALL if p not in OVERLAYS]


@pytest.fixture(scope="module")
def host() -> PluginHost:
    return PluginHost()


@pytest.fixture(autouse=True)
def no_weights(monkeypatch):
    monkeypatch.setattr(SD3Policy, "setup", lambda self, device: pytest.fail("validation loaded a model"))


def _required_data(*recipes: Path) -> list[str]:
    return [
        line.split(":", 1)[1].strip()
        for recipe in recipes
        for line in recipe.read_text().splitlines()
        if line.startswith("# requires-data:")
    ]


@pytest.fixture
def scratch(tmp_path, monkeypatch, standin_weights):  # noqa: F811 - the fixture imported above
    """Run validation from a scratch working directory (stand-in data files go there), with stand-ins of the model
    weights and reward checkpoints the recipes name (validation checks they are installed; nothing loads them)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "assets").symlink_to(ROOT / "assets")  # shipped models (assets/digits-sd3) resolve as in the repo

    def provide(*recipes: Path) -> None:
        for rel in _required_data(*recipes):
            path = tmp_path / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("a photo of a cat\na watercolor painting of a lighthouse\n")

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
