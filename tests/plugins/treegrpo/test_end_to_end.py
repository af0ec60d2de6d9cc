"""End to end: ``rlpost train`` on the tiny TreeGRPO recipe (and with an advantage-estimator overlay)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.weights_standins import standin_weights  # noqa: F401 - fixture

RECIPE = "recipes/tiny/treegrpo.yaml"
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


def _train(args: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run ``rlpost train`` and return the metrics lines and the trainable parameters before/after."""
    from rlpost.apps import cli
    from rlpost.engine.runner import Runner

    seen: dict[str, Any] = {}
    setup = Runner.setup

    def spy(self: Runner) -> None:
        setup(self)
        seen["runner"] = self
        seen["before"] = [p.detach().clone() for p in self.recipe.model.trainable_parameters()]

    monkeypatch.setattr(Runner, "setup", spy)
    assert cli.main(["train", *args]) == 0
    seen["after"] = [p.detach().clone() for p in seen["runner"].recipe.model.trainable_parameters()]
    out = Path(seen["runner"].rundir.path)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return lines, seen


def test_train_two_iterations(tiny_sd3_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = [
        "--recipe",
        RECIPE,
        "--model.pretrained",
        str(tiny_sd3_dir),
        "--run.output_dir",
        str(tmp_path / "run"),
        "--run.max_steps",
        "2",
    ]
    lines, seen = _train(args, monkeypatch)
    assert [m["step"] for m in lines] == [1, 2]
    for metrics in lines:
        for key, value in metrics.items():
            assert isinstance(value, (int, float)) and math.isfinite(value), (key, value)
        for key in (
            "adv/abs_mean",
            "adv/leaf_std",
            "adv/backup_ess",
            "adv/zero_std_frac",
            "tree/window_start",
            "perf/rollout_forwards",
            "train/first_ratio_dev",
            "perf/train_forwards",
        ):
            assert key in metrics, key
    first = lines[0]
    assert first["train/first_ratio_dev"] <= 1e-6
    recipe = seen["runner"].recipe
    counts = recipe.counts()
    assert first["perf/images"] == counts.images
    assert first["train/edges"] == counts.trainable_edges
    assert first["perf/train_forwards"] == counts.train_forwards  # one forward per window parent
    # The rollout forwards depend on the drawn window start: check the closed form at that start.
    for m in lines:
        assert m["perf/rollout_forwards"] == recipe.sampler.rollout_forwards_at(int(m["tree/window_start"]), 2)
    changed = [not torch.equal(a, b) for a, b in zip(seen["before"], seen["after"], strict=True)]
    assert seen["before"] and any(changed), "no trainable parameter changed"


def test_leaf_zscore_overlay_runs(tiny_sd3_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rlpost.apps import cli

    args = [
        "--recipe",
        RECIPE,
        "--recipe",
        "recipes/ablations/treegrpo_leaf_zscore.yaml",
        "--model.pretrained",
        str(tiny_sd3_dir),
        "--run.output_dir",
        str(tmp_path / "run"),
        "--run.max_steps",
        "1",
    ]
    assert cli.main(["validate", *args]) == 0
    lines, seen = _train(args, monkeypatch)
    assert seen["runner"].recipe.advantage.name == "leaf-zscore"
    assert len(lines) == 1 and all(math.isfinite(v) for v in lines[0].values())
    assert "adv/backup_ess" not in lines[0]


@pytest.mark.parametrize("overlay", sorted(p.name for p in (ROOT / "recipes" / "ablations").glob("treegrpo_*.yaml")))
def test_ablation_overlays_validate(overlay: str, tiny_sd3_dir: Path, tmp_path: Path, standin_weights: Path) -> None:  # noqa: F811
    """Every TreeGRPO ablation overlay validates on the tiny recipe and on the SD3.5 recipe (no weights load; the
    SD3.5 weights and reward checkpoints are stood in, tests/weights_standins.py)."""
    from rlpost.apps import cli

    tiny = ["--recipe", RECIPE, "--recipe", f"recipes/ablations/{overlay}", "--model.pretrained", str(tiny_sd3_dir)]
    assert cli.main(["validate", *tiny]) == 0
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\na dog\n")
    sd35 = ["--recipe", "recipes/treegrpo_sd35.yaml", "--recipe", f"recipes/ablations/{overlay}"]
    sd35 += ["--prompts.path", str(prompts), "--eval.sets.hpdv2.init_args.path", str(prompts)]
    assert cli.main(["validate", *sd35]) == 0
