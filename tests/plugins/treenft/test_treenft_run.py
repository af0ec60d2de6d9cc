"""TreeNFT end to end on the tiny SD3 (recipes/tiny/treenft_sd3.yaml): two steps through the CLI, the rows a step
runs are the ones ``train_counts`` promises, the old copy lags the live weights, a resume continues weights and old
copy bit for bit, and recipe validation refuses what the rule cannot run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import rlpost_treenft
from rlpost.apps.host import build_host
from rlpost.core.plugins import PluginHost
from rlpost.engine.recipe import RecipeError, validate
from rlpost.engine.runner import Runner
from rlpost_treenft.update import OLD
from tests.plugins.old_copy_helpers import check_old_copy_lags, check_resume_bitwise
from tests.unit.components.chain_helpers import check_recipe_trains_two_steps

ROOT = Path(__file__).resolve().parents[3]
TINY = "recipes/tiny/treenft_sd3.yaml"


@pytest.fixture(scope="module")
def host() -> PluginHost:
    """The plugin host with ``tree-nft``: from its entry point where the checkout declares it, else registered here."""
    host = build_host()
    return host if "tree-nft" in host.registry("optimizer").names() else build_host(extra_plugins=(rlpost_treenft,))


def _cfg(tiny_sd3_dir: Path, out: Path, steps: int) -> dict[str, Any]:
    cfg = yaml.safe_load((ROOT / TINY).read_text())
    cfg["model"]["init_args"]["pretrained"] = str(tiny_sd3_dir)
    cfg["sampler"]["init_args"].update(window="fixed", fixed_start=1)
    cfg["run"].update({"output_dir": str(out), "max_steps": steps, "groups_per_step": 2})
    cfg["copies"] = {OLD: {"rate": 0.25, "cap": 0.5}}  # a copy that visibly lags within two steps
    cfg["checkpoint"] = {"every": 1}
    return cfg


def test_two_steps_through_the_cli(tiny_sd3_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    lines, _ = check_recipe_trains_two_steps(TINY, tiny_sd3_dir, tmp_path / "run", "sd3", "rlpost.models.sd3.SD3Policy")
    for line in lines:
        assert line["train/nodes"] == 6 and line["perf/train_forwards"] == 6  # 2 trees x (1 + 2) window parents
        assert line["perf/reference_forwards"] == 12 and line["train/edges"] == 0


def test_step_runs_the_promised_rows_and_the_old_copy_lags(tmp_path, tiny_sd3_dir, host):
    cfg = _cfg(tiny_sd3_dir, tmp_path / "run", 1)
    cfg["optimizer"]["init_args"].update(nodes="window+trunk", fresh_rows=1)
    recipe = validate(json.loads(json.dumps(cfg)), host)
    runner = Runner(recipe, host)
    runner.begin()
    try:
        start = [p.detach().clone() for p in runner.backend.parameters]  # type: ignore[union-attr]
        rows0 = recipe.model.forward_count
        metrics = runner.step()
    finally:
        runner.finish("completed")
    counts, train = recipe.counts(), recipe.train_counts()
    # 2 trees, window start 1: 1 trunk + 3 window parents + 4 leaves x 1 tail step = 8 rollout rows per tree.
    assert (counts.images, counts.rollout_forwards) == (8, 16)
    rows = 2 * (1 + 3) + 8 * 1  # trunk and window nodes, one fresh row per leaf
    assert (train.grad_rows, dict(train.nograd_rows)) == (rows, {OLD: rows, "reference": rows})
    assert recipe.model.forward_count - rows0 == counts.rollout_forwards + train.grad_rows + train.nograd_total
    assert metrics["perf/train_forwards"] == rows and metrics["perf/reference_forwards"] == 2 * rows
    assert metrics["copies/old_decay"] == 0.25 and metrics["train/optimizer_steps"] == 1
    for key in ("loss/policy", "loss/kl", "train/optimality_r_mean", "train/old_deviate", "train/sigma_mean"):
        assert key in metrics and torch.isfinite(torch.tensor(metrics[key])), key
    check_old_copy_lags(runner, start, OLD, decay=0.25)  # copies.old rate 0.25 after step 1


def test_resume_continues_weights_and_old_copy_bitwise(tmp_path, tiny_sd3_dir, host):
    """2 steps equal 1 step + resume + 1 step: the LoRA weights and the old copy (saved in the run state), hence the
    second rollout, which runs under the old copy."""
    check_resume_bitwise(host, lambda out, steps: _cfg(tiny_sd3_dir, out, steps), tmp_path, OLD)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda c: c.pop("copies"), "copies: optimizer 'tree-nft' needs a weight copy 'old'"),
        (
            lambda c: c.update(sampler={"class_path": "solver", "init_args": {"num_steps": 4}}),
            "optimizer: 'tree-nft' requires the capability 'tree'",
        ),
        (
            lambda c: c["optimizer"]["init_args"].update(fresh_rows=5),
            "optimizer.init_args.fresh_rows: 5 levels per leaf, but the rollout's grid may have only 4",
        ),
        (
            lambda c: c["model"]["init_args"].update(lora=None, full_finetune=True),
            "optimizer.init_args.kl_beta: 0.0001 needs a frozen reference, but the model is fully fine-tuned",
        ),
    ],
    ids=["no-old-copy", "chain-sampler", "too-many-fresh-rows", "full-finetune-without-reference"],
)
def test_validation_refuses(tmp_path, tiny_sd3_dir, host, change, problem):
    cfg = _cfg(tiny_sd3_dir, tmp_path / "v", 1)
    change(cfg)
    with pytest.raises(RecipeError) as info:
        validate(cfg, host)
    assert problem in str(info.value)
