"""TensorBoard sink (rlpost.engine.logging_): besides the scalars, the sample grids, the resolved recipe and an HParams
session, read back from the event files with TensorBoard's own EventAccumulator."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from rlpost.apps.host import build_host
from rlpost.engine.logging_ import flat_hparams
from rlpost.engine.recipe import validate
from rlpost.engine.runner import Runner
from tests import toy_components
from tests.tolerances import assert_pixels_close
from tests.toy_components import toy_recipe


def test_flat_hparams_dotted_scalars_only():
    recipe = {
        "run": {"seed": 3, "device": "cpu", "progress": False, "note": None},
        "prompts": {"init_args": {"prompts": [f"prompt {i}" for i in range(1000)]}},
        "rewards": [{"class_path": "a", "weight": 0.5}, {"class_path": "b", "weight": float("nan")}],
        "torch_optimizer": {"init_args": {"lr": 1e-4, "betas": [0.9, 0.999]}},
    }
    assert flat_hparams(recipe) == {
        "run.seed": 3,
        "run.device": "cpu",
        "run.progress": False,
        "prompts.init_args.prompts": "[1000 items]",
        "rewards.0.class_path": "a",
        "rewards.0.weight": 0.5,
        "rewards.1.class_path": "b",
        "torch_optimizer.init_args.lr": 1e-4,
        "torch_optimizer.init_args.betas.0": 0.9,
        "torch_optimizer.init_args.betas.1": 0.999,
    }


def test_tensorboard_gets_grids_recipe_and_hparams(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    host = build_host(load_entrypoints=False, extra_plugins=(toy_components,))
    run = tmp_path / "run"
    cfg = toy_recipe(str(run), max_steps=3, device="cpu")
    cfg["logging"] = {"tensorboard": True, "grid_every": 1}
    cfg["eval"] = {
        "prompts": {"class_path": "prompt-list", "init_args": {"prompts": ["held out one", "held out two"]}},
        "num_steps": 2,
        "every": 2,
        "batch_size": 2,
    }
    Runner(validate(cfg, host), host).run()

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0, "tensors": 0, "scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward/weighted")] == [1, 2, 3]

    # Every saved grid, pixel for pixel as written to grids/step_N.png.
    images = acc.Images("samples/grid")
    assert [e.step for e in images] == [1, 2, 3]
    for event in images:
        on_disk = np.asarray(Image.open(run / "grids" / f"step_{event.step:06d}.png").convert("RGB"))
        logged = np.asarray(Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB"))
        assert (event.height, event.width) == on_disk.shape[:2]
        assert_pixels_close(logged, on_disk)

    # The held-out grids of each evaluation (step 0, every 2 steps, the end).
    evals = acc.Images("eval/grid")
    assert [e.step for e in evals] == [0, 2, 3]
    for event in evals:
        on_disk = np.asarray(Image.open(run / "eval" / f"step_{event.step:06d}.png").convert("RGB"))
        assert_pixels_close(np.asarray(Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB")), on_disk)

    # The resolved recipe, as YAML text.
    (text_event,) = acc.Tensors("recipe/text_summary")
    text = text_event.tensor_proto.string_val[0].decode()
    assert "class_path: tests.toy_components.ToyChainSampler" in text and "grid_every: 1" in text

    # The HParams session: recipe settings as hyperparameters, reward series as its metrics.
    content = acc.PluginTagToContent("hparams")
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    metrics = {m.name.tag for m in experiment.metric_infos}
    assert {"reward/weighted", "reward/toy-brightness", "eval/toy-brightness"} <= metrics
    assert not any(m.startswith("perf/") for m in metrics)
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hparams = start.session_start_info.hparams
    assert hparams["sampler.class_path"].string_value == "tests.toy_components.ToyChainSampler"
    assert hparams["torch_optimizer.init_args.lr"].number_value == pytest.approx(0.1)
    assert hparams["run.max_steps"].number_value == 3
    assert "_hparams_/session_end_info" in content
