"""TempFlow-GRPO through the CLI on the tiny SD3 (recipes/tiny/tempflow_sd3.yaml): two steps train end to end, the
logged rows equal the sampler's closed form, and the importance ratio is 1 before the first update."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.components.chain_helpers import check_recipe_trains_two_steps

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the recipe is named relative to the repository root


def test_two_steps_on_tiny_sd3(tiny_sd3_dir: Path, tmp_path: Path) -> None:
    sd3 = "rlpost.models.sd3.SD3Policy"
    lines, _ = check_recipe_trains_two_steps(
        "recipes/tiny/tempflow_sd3.yaml", tiny_sd3_dir, tmp_path / "run", "sd3", sd3
    )
    # 2 groups x 2 trunks; per trunk 3 trunk rows + 2 children x (3 + 2 + 1) completion rows; 12 images per prompt.
    for line in lines:
        assert line["perf/rollout_forwards"] == 4 * (3 + 2 * 6)
        assert line["perf/images"] == 2 * 12
        assert line["train/edges"] == 2 * 12
        assert line["train/optimizer_steps"] == 2
