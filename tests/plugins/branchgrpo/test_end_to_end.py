"""BranchGRPO through the CLI on the tiny SD3 (recipes/tiny/branchgrpo_sd3.yaml): two steps train, the logged rows
are the sampler's closed form, and the update rule scales each edge by 1 / (trained edges per tree)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlpost.core.contract import PromptBatch
from rlpost_branchgrpo.sampler import BranchSampler
from rlpost_branchgrpo.update import edges_per_tree
from tests.unit.components.chain_helpers import check_recipe_trains_two_steps

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


def test_tiny_sd3_recipe_trains_two_steps(tiny_sd3_dir: Path, tmp_path: Path) -> None:
    recipe = "recipes/tiny/branchgrpo_sd3.yaml"
    lines, _ = check_recipe_trains_two_steps(
        recipe, tiny_sd3_dir, tmp_path / "run", "sd3", "rlpost.models.sd3.SD3Policy"
    )
    # 2 prompts x (1 + 2 + 4 + 4) rollout rows; 2 x (2 + 4 + 4) trained edges from 2 x (1 + 2 + 4) parents.
    assert lines[0]["perf/rollout_forwards"] == 22
    assert lines[0]["train/edges"] == 20
    assert lines[0]["perf/train_forwards"] == 14


def test_edges_per_tree_counts_roots(tiny_sd3_dir: Path) -> None:
    from rlpost.models import SD3Policy

    policy = SD3Policy(str(tiny_sd3_dir), dtype="float32", resolution=32, time_grid="shifted-linspace", shift=3.0)
    policy.setup(torch.device("cpu"))
    sampler = BranchSampler(num_steps=4, split_points=[0, 1])
    batch = PromptBatch(["a", "b", "c"], [{}] * 3, 4)
    sampler.begin_step(0, torch.Generator().manual_seed(0))
    with torch.no_grad():
        rollout = sampler.rollout(policy, batch, torch.Generator().manual_seed(0))
    assert edges_per_tree(rollout) == 2 + 4 + 4  # upstream's len(training_samples) // num_trees
