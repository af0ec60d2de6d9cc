"""Export and inference on the tiny SD3: the exported LoRA loads with ``StableDiffusion3Pipeline.load_lora_weights``
into a fresh pipeline and reproduces the run's held-out samples; ``rlpost sample`` reproduces them too."""

from __future__ import annotations

import importlib.util
import shutil

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from rlpost.apps import cli
from rlpost.core.plugins import PluginHost
from rlpost.engine.recipe import validate
from rlpost.engine.runner import Runner
from tests import toy_components
from tests.tolerances import assert_pixels_close

PROMPTS = ["a red cube", "a blue sphere"]
_find_spec = importlib.util.find_spec


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_sd3_dir):
    host = PluginHost(load_entrypoints=False, extra_plugins=(toy_components,))
    out = tmp_path_factory.mktemp("export") / "run"
    cfg = {
        "run": {"seed": 0, "output_dir": str(out), "max_steps": 2, "groups_per_step": 1, "samples_per_group": 2,
                "device": "cpu", "progress": False},
        "model": {"class_path": "sd3", "init_args": {"pretrained": str(tiny_sd3_dir), "dtype": "float32",
                  "resolution": 32, "guidance_scale": 1.0, "max_sequence_length": 32, "lora": {"rank": 4, "alpha": 8}}},
        "prompts": {"class_path": "prompt-list", "init_args": {"prompts": ["a green cone", "a yellow star"]}},
        "sampler": {"class_path": "toy-chain", "init_args": {"num_steps": 2}},
        "rewards": [{"class_path": "toy-brightness"}],
        "advantage": {"class_path": "toy-group"},
        "optimizer": {"class_path": "clipped-surrogate", "init_args": {"clip_range": 1.0, "minibatch_edges": 4}},
        "torch_optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.05}},
        "eval": {"prompts": {"class_path": "prompt-list", "init_args": {"prompts": PROMPTS}}, "num_steps": 3,
                 "seed": 5, "batch_size": 1},
        "checkpoint": {"every": 1, "keep_last": 1},
    }  # fmt: skip
    runner = Runner(validate(cfg, host), host)
    runner.run()
    return out, host


def _eval_images(run, step: int) -> list[np.ndarray]:
    return [np.asarray(Image.open(run / "eval" / f"step_{step:06d}" / f"{i:04d}.png")) for i in range(len(PROMPTS))]


def test_exported_lora_loads_into_fresh_pipeline_and_reproduces_eval(lora_run, tiny_sd3_dir, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    run, _ = lora_run
    assert cli.main(["export", "--run", str(run), "--out", str(tmp_path / "export")]) == 0
    card = (tmp_path / "export" / "README.md").read_text()
    assert "base_model:" in card and "sampler=toy-chain" in card and "toy-brightness" in card and "| 2 |" in card
    pipe = StableDiffusion3Pipeline.from_pretrained(str(tiny_sd3_dir), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(tmp_path / "export"))
    trained, before = _eval_images(run, 2), _eval_images(run, 0)
    assert any(not np.array_equal(a, b) for a, b in zip(trained, before, strict=True)), "training must change images"
    for i, prompt in enumerate(PROMPTS):
        image = pipe(
            prompt, num_inference_steps=3, guidance_scale=1.0, height=32, width=32, max_sequence_length=32,
            generator=torch.Generator().manual_seed(5 + i), output_type="np",
        ).images[0]  # fmt: skip
        got = (image * 255).round().astype(np.uint8)
        assert np.abs(got.astype(int) - trained[i].astype(int)).max() <= 1, f"prompt {i} differs from the run's eval"


def test_sample_cli_reproduces_eval(lora_run, tmp_path, monkeypatch):
    run, host = lora_run
    monkeypatch.setattr(cli, "get_host", lambda: host)
    args = ["sample", "--run", str(run), "--out", str(tmp_path / "s"), "--num-steps", "3", "--seed", "5"]
    assert cli.main([*args, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1]]) == 0
    for i, expected in enumerate(_eval_images(run, 2)):
        # Same noise and sigmas through another entry point: at most one level apart after rounding (fp32 kernels).
        assert_pixels_close(np.asarray(Image.open(tmp_path / "s" / f"{i:04d}.png")), expected)
    assert cli.main(["export", "--run", str(tmp_path / "nowhere"), "--out", str(tmp_path / "e")]) == 2


def test_sample_does_not_revalidate_trackers_or_the_training_device(lora_run, tmp_path, monkeypatch):
    # A run trained on a GPU host with TensorBoard and W&B samples on a host with neither.
    run, host = lora_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    stored = yaml.safe_load((copy / "recipe.yaml").read_text())
    stored["logging"] = {**stored.get("logging", {}), "tensorboard": True, "wandb": True}
    stored["run"]["device"] = "cuda:4096"
    (copy / "recipe.yaml").write_text(yaml.safe_dump(stored, sort_keys=False))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("tensorboard", "wandb") else
                        _find_spec(name, *a))  # fmt: skip
    monkeypatch.setattr(cli, "get_host", lambda: host)
    args = ["sample", "--run", str(copy), "--out", str(tmp_path / "s"), "--num-steps", "2", "--device", "cpu"]
    assert cli.main([*args, "--prompt", PROMPTS[0]]) == 0
    assert (tmp_path / "s" / "0000.png").is_file()
