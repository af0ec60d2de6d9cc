"""Qwen-Image through the unchanged seam, as a plugin: every algorithm's tiny recipe trains two steps on the tiny
Qwen-Image through the CLI and the runner, a recipe with a resolution the model cannot take fails ``rlpost validate``
naming the field before any weight loads, and a LoRA trained by DanceGRPO, exported with ``rlpost export``, loads
with ``QwenImagePipeline.load_lora_weights`` and reproduces the run's held-out images and ``rlpost sample``
(mirrors tests/unit/models/test_flux_algorithms.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from diffusers import DiffusionPipeline, QwenImagePipeline
from huggingface_hub import ModelCard
from PIL import Image

from rlpost.apps import cli
from rlpost.apps.host import build_host
from rlpost.engine.recipe import validate
from rlpost.engine.runner import Runner
from tests.tolerances import PIXEL_ATOL, assert_pixels_close
from tests.unit.components.chain_helpers import check_recipe_trains_two_steps

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = ["a red cube", "two birds in a tree"]
EVAL_STEPS, EVAL_SEED, CFG = 3, 5, 4.0

ALGORITHMS = {
    "treegrpo": "recipes/tiny/treegrpo_qwenimage.yaml",
    "dancegrpo": "recipes/tiny/dancegrpo_qwenimage.yaml",
    "mixgrpo": "recipes/tiny/mixgrpo_qwenimage.yaml",
    "ddpo": "recipes/tiny/ddpo_qwenimage.yaml",
    "tempflow": "recipes/tiny/tempflow_qwenimage.yaml",
    "branchgrpo": "recipes/tiny/branchgrpo_qwenimage.yaml",
    "flowgrpo": "recipes/tiny/flowgrpo_qwenimage.yaml",
    "flowgrpo_fast": "recipes/tiny/flowgrpo_fast_qwenimage.yaml",
    "grpo_guard": "recipes/tiny/grpo_guard_qwenimage.yaml",
    "treenft": "recipes/tiny/treenft_qwenimage.yaml",
}


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the recipes are named relative to the repository root


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_two_steps_on_tiny_qwenimage(algorithm: str, tiny_qwenimage_dir: Path, tmp_path: Path) -> None:
    qwen = "rlpost_qwenimage.policy.QwenImagePolicy"  # the plugin's class, resolved from its short name
    run = tmp_path / "run"
    lines, model = check_recipe_trains_two_steps(ALGORITHMS[algorithm], tiny_qwenimage_dir, run, "qwen-image", qwen)
    # trees and Flow-GRPO-Fast's nocfg preset: no CFG
    assert model["init_args"]["true_cfg_scale"] == (
        1.0 if algorithm in ("treegrpo", "branchgrpo", "flowgrpo_fast", "treenft") else CFG
    )
    if algorithm == "dancegrpo":
        # 2 groups x 4 samples x 4 steps, counted per row before the CFG doubling; the grid ends at 0.02 -> 0, so
        # only the first two steps are SDE steps and trained (clean_tail_steps() == 2).
        assert lines[0]["perf/rollout_forwards"] == 2 * 4 * 4
        assert lines[0]["train/edges"] == 2 * 4 * 2


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_validate_names_a_bad_resolution_before_any_weight_loads(
    algorithm: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``rlpost validate`` of a tiny recipe at 30 px (not a multiple of the tiny VAE factor 2 x the 2x2 packing)
    exits 2 naming ``model.init_args.resolution``; no pipeline loads and the tiny model is not even built."""
    monkeypatch.setenv("RLPOST_CACHE", str(tmp_path / "cache"))

    def no_loading(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("validate loaded a pipeline")

    monkeypatch.setattr(QwenImagePipeline, "from_pretrained", no_loading)
    assert cli.main(["validate", "--recipe", ALGORITHMS[algorithm], "--model.resolution", "30"]) == 2
    err = capsys.readouterr().err
    assert "model.init_args.resolution: 30 is not a multiple of 4" in err, err
    assert not (tmp_path / "cache").exists()
    assert cli.main(["validate", "--recipe", ALGORITHMS[algorithm]]) == 0, capsys.readouterr().err


@pytest.fixture(scope="module")
def qwen_lora_run(tmp_path_factory: pytest.TempPathFactory, tiny_qwenimage_dir: Path) -> Path:
    """Two DanceGRPO steps (the tiny recipe, true CFG on) with held-out evaluation at steps 0 and 2; the learning
    rate is raised so that two steps change the evaluation images well beyond the pixel tolerance."""
    out = tmp_path_factory.mktemp("qwen-export") / "run"
    cfg = yaml.safe_load((ROOT / ALGORITHMS["dancegrpo"]).read_text())
    cfg["run"] |= {"output_dir": str(out), "max_steps": 2}
    cfg["model"]["init_args"]["pretrained"] = str(tiny_qwenimage_dir)
    cfg["torch_optimizer"]["init_args"]["lr"] = 0.2
    cfg["eval"] = {
        "prompts": {"class_path": "prompt-list", "init_args": {"prompts": PROMPTS}},
        "num_steps": EVAL_STEPS,
        "seed": EVAL_SEED,
        "batch_size": 1,
    }
    cfg["checkpoint"] = {"every": 1, "keep_last": 1}
    host = build_host()
    Runner(validate(cfg, host), host).run()
    return out


def _eval_images(run: Path, step: int) -> list[np.ndarray]:
    return [np.asarray(Image.open(run / "eval" / f"step_{step:06d}" / f"{i:04d}.png")) for i in range(len(PROMPTS))]


def test_exported_qwenimage_lora_loads_and_reproduces_eval_and_sample(
    qwen_lora_run: Path, tiny_qwenimage_dir: Path, tmp_path: Path
) -> None:
    run = qwen_lora_run
    export = tmp_path / "export"
    assert cli.main(["export", "--run", str(run), "--out", str(export)]) == 0
    card = ModelCard.load(export / "README.md")
    # A local base is no Hub id: left out of the metadata (which the Hub links), named in the usage snippet.
    assert card.data.base_model is None and f'from_pretrained("{tiny_qwenimage_dir.resolve()}")' in card.text
    assert card.data.pipeline_tag == "text-to-image" and "lora" in card.data.tags
    assert "DiffusionPipeline.from_pretrained" in card.text and "load_lora_weights" in card.text
    # Follow the card: DiffusionPipeline resolves QwenImagePipeline from model_index.json.
    pipe = DiffusionPipeline.from_pretrained(str(tiny_qwenimage_dir), torch_dtype=torch.float32)
    assert isinstance(pipe, QwenImagePipeline)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(export))
    trained, before = _eval_images(run, 2), _eval_images(run, 0)
    assert trained[0].shape == (32, 32, 3)
    # The tiny VAE decodes at low contrast; the raised learning rate moves every image by far more than the
    # tolerance (measured 52 and 71 levels), so matching within PIXEL_ATOL shows the adapter loaded at its scale.
    moved = [int(np.abs(a.astype(int) - b).max()) for a, b in zip(trained, before, strict=True)]
    assert min(moved) > 10 * PIXEL_ATOL, moved
    for i, prompt in enumerate(PROMPTS):
        image = pipe(
            prompt, negative_prompt=" ", true_cfg_scale=CFG, num_inference_steps=EVAL_STEPS, height=32, width=32,
            max_sequence_length=32, generator=torch.Generator().manual_seed(EVAL_SEED + i), output_type="np",
        ).images[0]  # fmt: skip
        assert_pixels_close((image * 255).round().astype(np.uint8), trained[i])
    # rlpost sample rebuilds the Qwen-Image policy (through its entry point) from the run's recipe.
    args = ["sample", "--run", str(run), "--out", str(tmp_path / "s"), "--num-steps", str(EVAL_STEPS)]
    assert cli.main([*args, "--seed", str(EVAL_SEED), "--prompt", PROMPTS[0], "--prompt", PROMPTS[1]]) == 0
    for i, expected in enumerate(trained):
        assert_pixels_close(np.asarray(Image.open(tmp_path / "s" / f"{i:04d}.png")), expected)
