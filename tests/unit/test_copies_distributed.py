"""Weight copies under DeepSpeed ZeRO-2 and ZeRO-3 on CPU ranks (gloo), with DiffusionNFT on the tiny SD3: its
rollouts run under the "old" copy and its loss evaluates the old copy and the frozen reference, so every way a copy is
used (swapped in for a rollout, for a no-grad forward inside the update; gathered for a checkpoint) runs sharded.

The reference is one rank with ``zero_stage: 0`` (as in tests/unit/test_ema_distributed.py). At step 1 every input is
the same up to rounding (the copy still equals the initial weights), so the live weights and the copy must agree with
the reference: a copy swapped in wrongly under sharding changes the old-policy forwards and with them the gradient.
At step 2 the copy recursion ``old2 = d·old1 + (1-d)·w2`` is checked within each run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from rlpost.engine.checkpoint import find_checkpoint, read_checkpoint
from tests.unit.test_distributed import ROOT, _assert_same, _launch, _weights, _write

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

RATE = 0.3  # d(1) = 0.3, d(2) = 0.5 (cap)


def _nft_recipe(tiny_sd3_dir: Path, out: Path, **distributed: Any) -> dict[str, Any]:
    cfg = yaml.safe_load((ROOT / "recipes" / "tiny" / "nft_sd3.yaml").read_text())
    cfg["model"]["init_args"]["pretrained"] = str(tiny_sd3_dir)
    cfg["run"].update({"output_dir": str(out), "progress": False, "max_steps": 2})
    cfg["copies"] = {"old": {"rate": RATE, "cap": 0.5}}
    cfg["torch_optimizer"]["init_args"]["lr"] = 0.02  # large: the copy and the live weights differ visibly
    cfg["checkpoint"] = {"every": 1, "keep_last": 0}
    cfg["distributed"] = distributed
    return cfg


def _old(run: Path, step: int) -> dict[str, torch.Tensor]:
    _, state, _ = read_checkpoint(find_checkpoint(str(run / "checkpoints" / f"step_{step:06d}"), run))
    return dict(state["copies"]["old"])


@pytest.fixture(scope="module")
def runs(tiny_sd3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("copies_ds")
    _launch(_write(tmp, "ref", _nft_recipe(tiny_sd3_dir, tmp / "ref", zero_stage=0)), 1)
    return tmp


@pytest.mark.parametrize("stage", [2, 3])
def test_copies_under_zero_match_one_rank(runs: Path, tiny_sd3_dir: Path, stage: int) -> None:
    name = f"z{stage}"
    _launch(_write(runs, name, _nft_recipe(tiny_sd3_dir, runs / name, zero_stage=stage)), 2)
    ref, run = runs / "ref", runs / name
    _assert_same(_weights(ref, 1), _weights(run, 1))
    _assert_same(_old(ref, 1), _old(run, 1))
    old1, old2, w2 = _old(run, 1), _old(run, 2), _weights(run, 2)
    assert old2.keys() == w2.keys()
    for key in old2:  # after step 2 the decay is min(0.5, 0.3·2) = 0.5
        assert torch.allclose(old2[key], 0.5 * old1[key] + 0.5 * w2[key], atol=1e-6, rtol=0), key
    assert any(not torch.allclose(old2[k], w2[k], atol=1e-4) for k in old2), "the copy should lag the live weights"
