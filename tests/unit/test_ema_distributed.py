"""EMA under DeepSpeed ZeRO-2 and ZeRO-3 on CPU ranks (gloo): no crash; EMA weights, held-out evaluation images and
LoRA artefacts equal to those of a reference run whose EMA holds plain full copies; the EMA recursion holds; a ZeRO-3
EMA run resumes (on another number of ranks) to the same result.

The reference is one rank with ``zero_stage: 0`` (no sharding: the EMA shadows the parameters themselves). A run
without a ``distributed`` section is no reference: it draws its rollouts from other RNG streams. Runs are compared
where their inputs are the same up to rounding (after step 1); after that, rollouts scored by a discontinuous reward
(JPEG size) may legitimately part, so step 2 is checked by the EMA recursion within each run instead.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from rlpost.apps.host import build_host
from tests.unit.test_distributed import _assert_same, _launch, _tree_recipe, _weights, _write

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

DECAY = 0.5


def _ema_recipe(tiny_sd3_dir: Path, out: Path, **distributed: Any) -> dict[str, Any]:
    """Two TreeGRPO steps on the tiny SD3 with LoRA, EMA, a checkpoint and a held-out evaluation after each step.

    The learning rate is large so that the live and EMA weights differ visibly in the evaluation images: an
    evaluation or artefact that missed the EMA weights does not match the reference.
    """
    cfg = _tree_recipe(tiny_sd3_dir, out, build_host(), **distributed)
    cfg["torch_optimizer"]["init_args"]["lr"] = 0.05
    cfg["ema"] = {"decay": DECAY}
    cfg["checkpoint"] = {"every": 1, "keep_last": 0}
    cfg["eval"] = {
        "prompts": {"class_path": "prompt-list", "init_args": {"prompts": ["a red cube", "a blue sphere"]}},
        "num_steps": 3,
        "every": 1,
        "seed": 7,
        "save_images": True,
    }
    return cfg


def _ema(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step_{step:06d}" / "ema.safetensors"))


def _lora(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step_{step:06d}" / "lora" / "pytorch_lora_weights.safetensors"))


def _eval_images(run: Path, step: int) -> list[np.ndarray]:
    files = sorted((run / "eval" / f"step_{step:06d}").glob("*.png"))
    assert files, run
    return [np.asarray(Image.open(f).convert("RGB"), dtype=np.int16) for f in files]


@pytest.fixture(scope="module")
def runs(tiny_sd3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference (one rank, unsharded) and the same recipe on two ranks with ZeRO-3."""
    tmp = tmp_path_factory.mktemp("ema_ds")
    _launch(_write(tmp, "ref", _ema_recipe(tiny_sd3_dir, tmp / "ref", zero_stage=0)), 1)
    _launch(_write(tmp, "z3", _ema_recipe(tiny_sd3_dir, tmp / "z3", zero_stage=3)), 2)
    return tmp


def _check_against_reference(tmp: Path, name: str) -> None:
    ref, run = tmp / "ref", tmp / name
    _assert_same(_weights(ref, 1), _weights(run, 1))
    _assert_same(_ema(ref, 1), _ema(run, 1))
    # The LoRA artefact (written by rank 0) holds the EMA weights.
    _assert_same(_lora(ref, 1), _lora(run, 1))
    # Held-out evaluation (run by every rank) used the EMA weights.
    for a, b in zip(_eval_images(ref, 1), _eval_images(run, 1), strict=True):
        assert int(np.abs(a - b).max()) <= 1, name
    # The EMA recursion at step 2, against the run's own checkpointed live weights: s2 = d·s1 + (1-d)·w2.
    s1, s2, w2 = _ema(run, 1), _ema(run, 2), _weights(run, 2)
    assert s2.keys() == w2.keys()
    for key in s2:
        assert torch.allclose(s2[key], DECAY * s1[key] + (1 - DECAY) * w2[key], atol=1e-6, rtol=0), key
    assert any(not torch.allclose(s2[k], w2[k], atol=1e-3) for k in s2), "EMA and live weights should differ"


def test_zero3_ema_matches_reference(runs: Path) -> None:
    _check_against_reference(runs, "z3")


def test_zero2_ema_matches_reference(runs: Path, tiny_sd3_dir: Path) -> None:
    _launch(_write(runs, "z2", _ema_recipe(tiny_sd3_dir, runs / "z2", zero_stage=2)), 2)
    _check_against_reference(runs, "z2")


def test_zero3_ema_resume_on_one_rank(runs: Path, tiny_sd3_dir: Path) -> None:
    """The 2-rank ZeRO-3 run's step-1 checkpoint, resumed by one ZeRO-3 rank (another partitioning of the weights,
    optimizer state and EMA), reaches the uninterrupted run's step 2."""
    shutil.copytree(runs / "z3", runs / "resumed")
    shutil.rmtree(runs / "resumed" / "checkpoints" / "step_000002")
    _launch(_write(runs, "resumed", _ema_recipe(tiny_sd3_dir, runs / "resumed", zero_stage=3)), 1, "--resume", "latest")
    assert json.loads((runs / "resumed" / "resumes.jsonl").read_text())["step"] == 1
    _assert_same(_weights(runs / "z3", 2), _weights(runs / "resumed", 2))
    _assert_same(_ema(runs / "z3", 2), _ema(runs / "resumed", 2))
    _assert_same(_lora(runs / "z3", 2), _lora(runs / "resumed", 2))
