"""Trackers of ``logging.report_to`` (rlpost.engine.trackers on accelerate's tracker layer): names checked by
validation, the deprecated booleans, a resumed run continuing its W&B run, video grids."""

from __future__ import annotations

import importlib.util
import warnings

import numpy as np
import pytest
import torch
from PIL import Image, ImageSequence

from rlpost.apps.host import build_host
from rlpost.engine.recipe import RecipeError, validate
from rlpost.engine.runner import Runner
from rlpost.ops.images import save_video_grid
from tests import toy_components
from tests.toy_components import toy_recipe


@pytest.fixture
def host():
    return build_host(load_entrypoints=False, extra_plugins=(toy_components,))


def test_unknown_and_missing_trackers_are_refused_by_validate(tmp_path, host, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else find_spec(name, *a))
    cfg = toy_recipe(str(tmp_path / "run"))
    cfg["logging"] = {"report_to": ["tensorbord", "mlflow"], "init_kwargs": {"wandbb": {}}}
    with pytest.raises(RecipeError) as err:
        validate(cfg, host)
    text = str(err.value)
    assert "logging.report_to[0]: unknown tracker 'tensorbord'; choose from" in text and "tensorboard" in text
    assert "logging.report_to[1]: 'mlflow': the 'mlflow' package is not installed (pip install 'mlflow')" in text
    assert "logging.init_kwargs: unknown tracker(s) ['wandbb']" in text


def test_deprecated_booleans_become_report_to_with_a_warning(tmp_path, host):
    cfg = toy_recipe(str(tmp_path / "run"))
    cfg["logging"] = {"tensorboard": True, "wandb": False, "wandb_project": "mine"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recipe = validate(cfg, host)
    messages = {str(w.message) for w in caught if issubclass(w.category, FutureWarning)}
    assert "logging.tensorboard is deprecated; use logging.report_to: [tensorboard]" in messages
    assert "logging.wandb is deprecated; use logging.report_to: [wandb]" in messages
    assert "logging.wandb_project is deprecated; use logging.project" in messages
    assert recipe.logging.report_to == ["tensorboard"] and recipe.logging.project == "mine"
    # The run's recipe.yaml holds the new names only.
    assert recipe.config["logging"] == {"report_to": ["tensorboard"], "project": "mine", "init_kwargs": {},
                                        "grid_every": 0}  # fmt: skip


def _offline_runs(wandb_dir) -> list[str]:
    """The run ids of the offline W&B runs under ``wandb_dir`` (``wandb/offline-run-<time>-<id>``), oldest first."""
    return [p.name.rsplit("-", 1)[1] for p in sorted((wandb_dir / "wandb").glob("offline-run-*"))]


def test_a_resumed_run_continues_its_wandb_run(tmp_path, host, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb_home").mkdir()
    run = tmp_path / "run"

    def cfg(max_steps: int) -> dict:
        recipe = toy_recipe(str(run), max_steps=max_steps)
        recipe["logging"] = {"report_to": ["wandb"], "project": "rlpost-test"}
        recipe["checkpoint"] = {"every": 1, "keep_last": 5}
        return recipe

    Runner(validate(cfg(2), host), host).run()
    first = _offline_runs(tmp_path / "wandb_home")
    Runner(validate(cfg(3), host), host, resume=str(run / "checkpoints" / "step_000001")).run()
    runs = _offline_runs(tmp_path / "wandb_home")
    assert len(first) == 1 and len(runs) == 2
    assert runs[0] == runs[1] == (run / "wandb_run_id").read_text().strip()
    # A new run in another directory is another W&B run.
    Runner(validate({**cfg(1), "run": {**cfg(1)["run"], "output_dir": str(tmp_path / "other")}}, host), host).run()
    assert len(set(_offline_runs(tmp_path / "wandb_home"))) == 2


def test_video_grid_frames_are_the_samples_frames(tmp_path):
    # Two 3-frame clips of flat colours: frame t of the GIF shows each sample's frame t in its tile.
    colours = torch.tensor([[[255, 0, 0], [0, 255, 0], [0, 0, 255]], [[255, 255, 0], [0, 255, 255], [255, 0, 255]]])
    media = colours[:, :, None, None, :].expand(2, 3, 8, 8, 3).to(torch.uint8)
    path = save_video_grid(media, ["one", "two"], tmp_path / "v.gif", ncols=2)
    with Image.open(path) as gif:
        frames = [np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(gif)]
    assert len(frames) == 3
    cell = 128  # 8 px tiles are upscaled to 128 so captions stay readable (rlpost/ops/images.py)
    for t, frame in enumerate(frames):
        for i in range(2):
            tile = frame[:cell, i * cell : (i + 1) * cell].reshape(-1, 3)
            assert (tile == colours[i, t].numpy()).all(), (t, i)
