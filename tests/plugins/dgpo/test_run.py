"""DGPO through the Runner on the tiny SD3 (recipes/tiny/dgpo_sd3.yaml, shrunk): the weights train, the counted rows
match the rule's, rollouts switch to the ema_ref copy, and a resumed run is bitwise the uninterrupted one, copy
included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rlpost.apps.host import build_host
from rlpost.core.plugins import PluginHost
from rlpost.engine.recipe import merge_sources, validate
from rlpost.engine.runner import Runner

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def host() -> PluginHost:
    host = build_host()
    if "dgpo" in host.registry("optimizer").names():  # the installed entry point
        return host
    return build_host()


def _cfg(out: Path, tiny_sd3_dir: Path, steps: int) -> dict[str, Any]:
    cfg = merge_sources([str(ROOT / "recipes" / "tiny" / "dgpo_sd3.yaml")])
    cfg["run"].update({"output_dir": str(out), "max_steps": steps, "groups_per_step": 2, "samples_per_group": 2})
    cfg["model"]["init_args"]["pretrained"] = str(tiny_sd3_dir)
    cfg["sampler"]["init_args"]["num_steps"] = 2
    # Both grid indices of a 2-step grid; rollouts under ema_ref from step 1.
    cfg["optimizer"]["init_args"].update({"trunc_steps": 1, "switch_ema_ref": 0, "minibatch_samples": 2})
    cfg["checkpoint"] = {"every": 1, "keep_last": 0}
    return cfg


def test_tiny_run_trains_and_resumes_bitwise(tmp_path: Path, host: PluginHost, tiny_sd3_dir: Path) -> None:
    full = Runner(validate(_cfg(tmp_path / "full", tiny_sd3_dir, 3), host), host)
    history = full.run()
    assert [m["perf/train_forwards"] for m in history] == [8.0] * 3  # 4 samples x 2 timesteps
    assert [m["perf/reference_forwards"] for m in history] == [16.0] * 3  # the reference and ema_ref, 8 each
    assert [round(m["copies/ema_ref_decay"], 6) for m in history] == [0.001, 0.002, 0.003]
    assert all(m["train/nonfinite_loss"] == 0 for m in history)
    # peft's gaussian init starts every LoRA B at zero: a non-zero B has been trained.
    trained = [p for p in full.recipe.model.trainable_parameters() if float(p.detach().abs().max()) > 0]
    assert len(trained) > len(full.recipe.model.trainable_parameters()) // 2, "the B matrices never moved"

    part = Runner(validate(_cfg(tmp_path / "part", tiny_sd3_dir, 3), host), host)
    part.begin()
    try:
        for _ in range(2):
            part.step()
            part.save_checkpoint()
    finally:
        part.finish("interrupted")
    resumed = Runner(validate(_cfg(tmp_path / "part", tiny_sd3_dir, 3), host), host, resume="latest")
    resumed.run()
    assert full.copies is not None and resumed.copies is not None
    for x, y in zip(full.copies.shadows["ema_ref"], resumed.copies.shadows["ema_ref"], strict=True):
        assert torch.equal(x, y), "the ema_ref copy must be bitwise equal after resume"
    for x, y in zip(full.recipe.model.trainable_parameters(), resumed.recipe.model.trainable_parameters(), strict=True):
        assert torch.equal(x, y), "weights must be bitwise equal after resume"
    drop = ("perf/", "accelerate/")
    clean = [{k: v for k, v in m.items() if not k.startswith(drop)} for m in history]
    again = [{k: v for k, v in m.items() if not k.startswith(drop)} for m in resumed.ctx.history]
    assert clean == again, "rewards, losses and draws of every step must match after resume"
