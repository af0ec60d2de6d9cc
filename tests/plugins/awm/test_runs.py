"""AWM through the engine: recipes/tiny/awm_sd3.yaml on the tiny SD3 with the ``ema`` weight copy changes the
weights, logs the rule's metrics and counts, resumes bit for bit (weights, the ``ema`` copy, metrics), and
``skip_first_steps`` trains nothing on the skipped steps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from rlpost.apps.host import build_host
from rlpost.core.plugins import PluginHost
from rlpost.engine.recipe import validate
from rlpost.engine.runner import Runner

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def host() -> PluginHost:
    return build_host()


def _recipe(tiny_sd3_dir: Path, out: Path, steps: int, **awm: Any) -> dict[str, Any]:
    cfg = yaml.safe_load((ROOT / "recipes/tiny/awm_sd3.yaml").read_text())
    cfg["model"]["init_args"].update({"pretrained": str(tiny_sd3_dir), "resolution": 16})
    cfg["run"].update({"output_dir": str(out), "max_steps": steps, "groups_per_step": 2})
    cfg["optimizer"]["init_args"].update(awm)
    cfg["checkpoint"] = {"every": 1, "keep_last": 2}
    return cfg


def _run(host: PluginHost, cfg: dict[str, Any], resume: str | None = None) -> Runner:
    runner = Runner(validate(json.loads(json.dumps(cfg)), host), host, resume=resume)
    runner.run()
    return runner


def _history(runner: Runner) -> list[dict[str, float]]:
    """Every metric but timings and memory (``perf/*`` other than the row counts, ``accelerate/*``)."""
    keep = ("perf/train_forwards", "perf/reference_forwards", "perf/rollout_forwards")
    return [
        {k: v for k, v in m.items() if k in keep or not k.startswith(("perf/", "accelerate/"))}
        for m in runner.ctx.history
    ]


def test_runs_with_the_ema_copy_and_resumes_bitwise(tmp_path: Path, host: PluginHost, tiny_sd3_dir: Path) -> None:
    full = _run(host, _recipe(tiny_sd3_dir, tmp_path / "full", 2))
    assert full.backend is not None and full.copies is not None
    first = full.ctx.history[0]
    images = 4  # 2 groups x 2 samples
    assert first["perf/train_forwards"] == images * 2  # 2 timesteps per sample
    assert first["perf/reference_forwards"] == 2 * images * 2  # the reference and the ema copy
    assert first["copies/ema_decay"] == pytest.approx(0.001)
    for key in ("loss/policy", "loss/kl", "loss/kl_ema", "loss/flow_matching", "train/grad_norm"):
        assert key in first, key
    assert first["loss/kl"] > 0 or full.ctx.history[1]["loss/kl"] > 0
    start = Runner(validate(_recipe(tiny_sd3_dir, tmp_path / "start", 1), host), host)
    start.setup()
    assert start.backend is not None
    moved = [not torch.equal(a, b) for a, b in zip(full.backend.parameters, start.backend.parameters, strict=True)]
    assert any(moved), "two AWM steps left every trainable weight unchanged"

    _run(host, _recipe(tiny_sd3_dir, tmp_path / "part", 1))
    resumed = _run(host, _recipe(tiny_sd3_dir, tmp_path / "part", 2), resume="latest")
    assert resumed.backend is not None and resumed.copies is not None
    for a, b in zip(full.backend.parameters, resumed.backend.parameters, strict=True):
        assert torch.equal(a, b), "weights must be bitwise equal after resume"
    for a, b in zip(full.copies.shadows["ema"], resumed.copies.shadows["ema"], strict=True):
        assert torch.equal(a, b), "the ema copy must be bitwise equal after resume"
    assert _history(full) == _history(resumed)


def test_skipped_steps_train_nothing(tmp_path: Path, host: PluginHost, tiny_sd3_dir: Path) -> None:
    runner = _run(host, _recipe(tiny_sd3_dir, tmp_path / "skip", 2, skip_first_steps=1))
    skipped, trained = runner.ctx.history
    assert skipped["perf/train_forwards"] == 0 and skipped["perf/reference_forwards"] == 0
    assert skipped["train/skipped_step"] == 1.0
    assert trained["perf/train_forwards"] == 8 and "train/skipped_step" not in trained
