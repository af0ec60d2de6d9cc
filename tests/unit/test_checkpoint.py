"""Atomic checkpoints: pickle-free round trips, a save killed midway, rotation, non-finite weights refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rlpost.engine.checkpoint import (
    CheckpointError,
    find_checkpoint,
    join_tensors,
    list_checkpoints,
    read_checkpoint,
    rotate,
    split_tensors,
    write_checkpoint,
)


def _weights(v: float) -> dict[str, torch.Tensor]:
    return {"trainable.0000": torch.full((2, 3), v), "trainable.0001": torch.tensor(v)}


def test_state_round_trips_without_pickle():
    p = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.AdamW([p], lr=0.1, betas=(0.8, 0.9))
    p.sum().backward()
    opt.step()
    state = {
        "optimizer": opt.state_dict(),
        "python": (3, (1, 2), None),
        "numpy": np.random.get_state(),
        "gen": torch.Generator().manual_seed(3).get_state(),
    }
    tensors: dict[str, torch.Tensor] = {}
    tree = json.loads(json.dumps(split_tensors(state, tensors)))  # must be plain JSON
    back = join_tensors(tree, tensors)
    assert back["python"] == (3, (1, 2), None)
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.8, 0.9)
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert np.array_equal(back["numpy"][1], state["numpy"][1])
    assert torch.equal(back["gen"], state["gen"])
    with pytest.raises(TypeError, match="without pickle"):
        split_tensors({"f": object()}, {})


def test_checkpoint_round_trip(tmp_path):
    path = write_checkpoint(tmp_path, 3, _weights(1.0), {"step": 3, "x": torch.arange(4)})
    info = find_checkpoint("latest", tmp_path)
    assert info.path == path and info.step == 3
    weights, state, ema = read_checkpoint(info)
    assert torch.equal(weights["trainable.0000"], torch.ones(2, 3)) and ema is None
    assert state["step"] == 3 and torch.equal(state["x"], torch.arange(4))
    assert (path / "manifest.json").is_file()


def test_save_killed_midway_keeps_previous_latest(tmp_path):
    write_checkpoint(tmp_path, 2, _weights(1.0), {"step": 2})

    def crash(directory):
        assert (directory / "weights.safetensors").is_file()  # some files were already written
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        write_checkpoint(tmp_path, 4, _weights(2.0), {"step": 4}, extra=crash)
    # A directory without a manifest (e.g. a crash between rename and manifest in another tool) is ignored too.
    (tmp_path / "checkpoints" / "step_000009").mkdir()
    (tmp_path / "checkpoints" / "step_000009" / "weights.safetensors").write_bytes(b"partial")
    latest = find_checkpoint("latest", tmp_path)
    assert latest.step == 2
    assert read_checkpoint(latest)[0]["trainable.0000"].eq(1.0).all()
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]


def test_corrupt_file_is_detected(tmp_path):
    path = write_checkpoint(tmp_path, 1, _weights(1.0), {"step": 1})
    (path / "state.json").write_text(json.dumps({"step": 99}))
    with pytest.raises(CheckpointError, match="sha256"):
        read_checkpoint(find_checkpoint(str(path), tmp_path))


def test_rotation_keeps_newest_complete(tmp_path):
    for step in (1, 2, 3, 4):
        write_checkpoint(tmp_path, step, _weights(float(step)), {"step": step})
        rotate(tmp_path, keep_last=2)
    assert [c.step for c in list_checkpoints(tmp_path)] == [3, 4]


def test_nonfinite_weights_are_never_written(tmp_path):
    bad = _weights(1.0)
    bad["trainable.0001"] = torch.tensor(float("nan"))
    with pytest.raises(CheckpointError, match="non-finite weights"):
        write_checkpoint(tmp_path, 1, bad, {"step": 1})
    assert list_checkpoints(tmp_path) == []


def test_find_checkpoint_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        find_checkpoint("latest", tmp_path)
    with pytest.raises(CheckpointError, match="not found"):
        find_checkpoint(str(tmp_path / "nope"), tmp_path)
