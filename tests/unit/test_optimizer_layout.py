"""Optimizer-step layout on the tiny real-architecture SD3 (CPU): with several optimizer steps per rollout the
importance ratio leaves 1 after the first step and the PPO clip binds; with one step it stays at 1 for every
minibatch (the weights that produced the rollout evaluate all of it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


def _one_step_metrics(tiny_sd3_dir: Path, out: Path, *overrides: str) -> dict[str, Any]:
    from rlpost.apps import cli
    from rlpost.apps.host import reset_host

    reset_host(None)
    try:
        rc = cli.main(
            [
                "train",
                "--recipe",
                "recipes/tiny/treegrpo.yaml",
                "--model.pretrained",
                str(tiny_sd3_dir),
                "--run.output_dir",
                str(out),
                "--run.max_steps",
                "1",
                "--torch_optimizer.init_args.lr",
                "0.05",  # large on purpose: the first step must move the policy
                "--optimizer.minibatch_edges",
                "2",  # several minibatches per optimizer step
                *overrides,
            ]
        )
    finally:
        reset_host(None)
    assert rc == 0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len(lines) == 1
    return lines[0]


def test_several_optimizer_steps_let_the_ratio_leave_one_and_the_clip_bind(tiny_sd3_dir: Path, tmp_path: Path):
    # recipes/tiny/treegrpo.yaml: 2 trees x 3 window parents (k=2, depth 2) -> 6 parent units; 3 optimizer steps.
    m = _one_step_metrics(tiny_sd3_dir, tmp_path / "three", "--optimizer.optimizer_steps", "3")
    assert m["train/optimizer_steps"] == 3
    assert m["train/first_ratio_dev"] <= 1e-6  # before the first step: the rollout's own weights
    assert m["train/clipfrac_after_first"] > 0  # after it: |ratio - 1| > clip_range 1e-4 on some edges
    assert m["train/ratio_std_after_first"] > 1e-4
    assert max(abs(m["train/ratio_max"] - 1), abs(m["train/ratio_min"] - 1)) > 1e-4


def test_one_optimizer_step_keeps_the_ratio_at_one_for_every_minibatch(tiny_sd3_dir: Path, tmp_path: Path):
    m = _one_step_metrics(tiny_sd3_dir, tmp_path / "one", "--optimizer.optimizer_steps", "1")
    assert m["train/optimizer_steps"] == 1
    assert "train/clipfrac_after_first" not in m
    # Up to recomputation rounding (the rollout batches differently than the update), over all 3 minibatches.
    assert abs(m["train/ratio_max"] - 1) <= 1e-6 and abs(m["train/ratio_min"] - 1) <= 1e-6
    assert m["train/clipfrac"] == 0.0
