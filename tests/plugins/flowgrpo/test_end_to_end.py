"""Each Flow-GRPO preset trains two steps on the tiny SD3 through the CLI (recipes/tiny/{flowgrpo,flowgrpo_fast,
grpo_guard}_sd3.yaml): finite metrics, ratio 1 before the first update, weights move, and the logged rows are the
sampler's closed form (FLUX, Qwen-Image and Wan run the same presets in their ALGORITHMS tables)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.components.chain_helpers import check_end_to_end, train_two_iterations

ROOT = Path(__file__).resolve().parents[3]

# recipe -> (trained edges, reference rows) per step: 2 groups x 4 samples x 4 steps of rollout.
PRESETS = {
    "flowgrpo": (2 * 4 * 3, 2 * 4 * 3),  # int(4 x 0.99) = 3 trained steps, KL 0.01: one reference row each
    "flowgrpo_fast": (2 * 4 * 2, 0),  # the 2-step CPS window
    "grpo_guard": (2 * 4 * 3, 0),
}


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_two_steps_on_tiny_sd3(preset: str, tiny_sd3_dir: Path, tmp_path: Path) -> None:
    lines, probe = train_two_iterations(f"recipes/tiny/{preset}_sd3.yaml", tiny_sd3_dir, tmp_path / "run")
    check_end_to_end(lines, probe)
    edges, reference = PRESETS[preset]
    for line in lines:
        assert line["perf/rollout_forwards"] == 2 * 4 * 4
        assert line["train/edges"] == line["perf/train_forwards"] == edges
        assert line["perf/reference_forwards"] == reference
        assert line["train/optimizer_steps"] == 2
