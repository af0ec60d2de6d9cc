"""DiffusionNFT end to end on the tiny SD3 (recipes/tiny/nft_sd3.yaml): the rows a step runs are the ones
``train_counts`` promises, the old copy lags the live weights, a resume continues weights and old copy bit for bit,
and recipe validation refuses what the rule cannot run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import rlpost_nft
from rlpost.apps.host import build_host
from rlpost.core.plugins import PluginHost
from rlpost.engine.recipe import RecipeError, validate
from rlpost.engine.runner import Runner
from rlpost_nft.update import OLD
from tests.plugins.old_copy_helpers import check_old_copy_lags, check_resume_bitwise

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def host() -> PluginHost:
    """The plugin host with ``nft``: from its entry point where the checkout declares it, else registered here
    (registering the module a second time would make the host drop it)."""
    host = build_host()
    return host if "nft" in host.registry("optimizer").names() else build_host(extra_plugins=(rlpost_nft,))


def _cfg(tiny_sd3_dir: Path, out: Path, steps: int) -> dict[str, Any]:
    cfg = yaml.safe_load((ROOT / "recipes/tiny/nft_sd3.yaml").read_text())
    cfg["model"]["init_args"]["pretrained"] = str(tiny_sd3_dir)
    cfg["optimizer"]["class_path"] = "nft"
    cfg["run"].update({"output_dir": str(out), "max_steps": steps, "groups_per_step": 1, "samples_per_group": 3})
    cfg["copies"] = {OLD: {"rate": 0.25, "cap": 0.5}}  # a copy that visibly lags within two steps
    cfg["checkpoint"] = {"every": 1}
    return cfg


def test_step_runs_the_promised_rows_and_the_old_copy_lags(tmp_path, tiny_sd3_dir, host):
    cfg = _cfg(tiny_sd3_dir, tmp_path / "run", 1)
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
    assert (counts.images, counts.rollout_forwards) == (3, 12)  # 3 samples x 4 solver steps
    assert (train.grad_rows, dict(train.nograd_rows)) == (9, {OLD: 9, "reference": 9})  # int(4 x 0.99) = 3 each
    assert recipe.model.forward_count - rows0 == counts.rollout_forwards + train.grad_rows + train.nograd_total
    assert metrics["perf/train_forwards"] == 9 and metrics["perf/reference_forwards"] == 18
    assert metrics["copies/old_decay"] == 0.25 and metrics["train/optimizer_steps"] == 1
    for key in ("loss/policy", "loss/kl", "train/optimality_r_mean", "train/old_deviate"):
        assert key in metrics and torch.isfinite(torch.tensor(metrics[key])), key
    check_old_copy_lags(runner, start, OLD, decay=0.25)  # copies.old rate 0.25 after step 1


def test_resume_continues_weights_and_old_copy_bitwise(tmp_path, tiny_sd3_dir, host):
    """2 steps equal 1 step + resume + 1 step: the LoRA weights and the old copy (saved in the run state), hence the
    second rollout, which runs under the old copy."""
    check_resume_bitwise(host, lambda out, steps: _cfg(tiny_sd3_dir, out, steps), tmp_path, OLD)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda c: c.pop("copies"), "copies: optimizer 'nft' needs a weight copy 'old'"),
        (
            lambda c: c["optimizer"]["init_args"].update(timestep_fraction=0.2),
            "optimizer.init_args.timestep_fraction: int(4 steps x 0.2) = 0 timesteps would be trained",
        ),
        (
            lambda c: c.update(
                sampler={"class_path": "tree", "init_args": {"num_steps": 4, "k": 2, "depth": 1}},
                advantage={"class_path": "tree-backup"},
            ),
            "sampler: 'tree' rolls out 7 denoiser rows for 2 samples on a 4-step grid; nft counts one row per sample",
        ),
        (
            lambda c: c["model"]["init_args"].update(lora=None, full_finetune=True),
            "optimizer.init_args.kl_beta: 0.0001 needs a frozen reference, but the model is fully fine-tuned",
        ),
    ],
    ids=["no-old-copy", "no-timestep", "tree-sampler", "full-finetune-without-reference"],
)
def test_validation_refuses(tmp_path, tiny_sd3_dir, host, change, problem):
    cfg = _cfg(tiny_sd3_dir, tmp_path / "v", 1)
    change(cfg)
    with pytest.raises(RecipeError) as info:
        validate(cfg, host)
    assert problem in str(info.value)
