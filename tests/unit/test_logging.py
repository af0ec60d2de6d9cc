"""TensorBoard sink (rlpost.engine.logging_): besides the scalars, the sample grids, the resolved recipe and an HParams
session, read back from the event files with TensorBoard's own EventAccumulator."""

from __future__ import annotations

import io
import json

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


def _tensorboard_recipe(run, max_steps: int, grid_every: int = 0) -> dict:
    """A toy recipe logging to TensorBoard, evaluated on two held-out prompts at step 0, every 2 steps and the end."""
    cfg = toy_recipe(str(run), max_steps=max_steps, device="cpu")
    cfg["logging"] = {"tensorboard": True, "grid_every": grid_every}
    cfg["eval"] = {
        "prompts": {"class_path": "prompt-list", "init_args": {"prompts": ["held out one", "held out two"]}},
        "num_steps": 2,
        "every": 2,
        "batch_size": 2,
    }
    return cfg


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
    Runner(validate(_tensorboard_recipe(run, 3, grid_every=1), host), host).run()

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


def _dashboard_metrics(logdir) -> dict[str, tuple[float, int]]:
    """What TensorBoard's HParams dashboard shows for the run's session: metric -> (value, step), computed by the
    HParams plugin's own ListSessionGroups handler over the event files."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import api_pb2, backend_context, list_session_groups

    multiplexer = plugin_event_multiplexer.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(logdir))
    multiplexer.Reload()
    provider = data_provider.MultiplexerDataProvider(multiplexer, str(logdir))
    tb = base_plugin.TBContext(logdir=str(logdir), multiplexer=multiplexer, data_provider=provider)
    request = api_pb2.ListSessionGroupsRequest(
        start_index=0,
        slice_size=10,
        include_metrics=True,
        allowed_statuses=[api_pb2.STATUS_UNKNOWN, api_pb2.STATUS_SUCCESS, api_pb2.STATUS_RUNNING],
    )
    handler = list_session_groups.Handler(context.RequestContext(), backend_context.Context(tb), "", request)
    (group,) = handler.run().session_groups
    return {m.name.tag: (m.value, m.training_step) for m in group.metric_values}


def test_hparams_session_shows_the_final_metrics_also_after_a_resume(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    host = build_host(load_entrypoints=False, extra_plugins=(toy_components,))
    run = tmp_path / "run"

    def cfg(max_steps: int) -> dict:
        return {**_tensorboard_recipe(run, max_steps), "checkpoint": {"every": 1, "keep_last": 5}}

    Runner(validate(cfg(3), host), host).run()
    # Resume from step 2 (as after a crash at step 3) and run on to step 4: step 3's first events are orphaned.
    Runner(validate(cfg(4), host), host, resume=str(run / "checkpoints" / "step_000002")).run()

    final = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    final_eval = json.loads((run / "eval.jsonl").read_text().splitlines()[-1])
    assert final["step"] == final_eval["step"] == 4
    shown = _dashboard_metrics(run / "tensorboard")
    assert set(shown) >= {"reward/weighted", "reward/toy-brightness", "eval/toy-brightness"}
    for key in ("reward/weighted", "reward/toy-brightness"):
        assert shown[key] == (pytest.approx(final[key]), 4), key
    assert shown["eval/toy-brightness"] == (pytest.approx(final_eval["eval/toy-brightness"]), 4)
    # The resumed writer purged what the first process logged after the checkpoint: every step once.
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward/weighted")] == [1, 2, 3, 4]
