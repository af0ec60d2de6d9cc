"""FLUX.1 through the unchanged seam: every algorithm's tiny recipe trains two steps on the tiny FLUX, sampler
validation asks the adapter about its grid (no family names), and an exported FLUX LoRA loads with
``load_lora_weights`` and reproduces the run's held-out images and ``rlpost sample``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from rlpost.apps import cli
from rlpost.apps.host import build_host
from rlpost.core.plugins import PluginHost
from rlpost.engine.recipe import RecipeError, validate
from rlpost.engine.runner import Runner
from tests import toy_components
from tests.tolerances import assert_pixels_close
from tests.unit.components.chain_helpers import check_recipe_trains_two_steps

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = ["a red cube", "a blue sphere"]


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the recipes are named relative to the repository root


ALGORITHMS = {
    "treegrpo": "recipes/tiny/treegrpo_flux.yaml",
    "dancegrpo": "recipes/tiny/dancegrpo_flux.yaml",
    "mixgrpo": "recipes/tiny/mixgrpo_flux.yaml",
    "ddpo": "recipes/tiny/ddpo_flux.yaml",
    "tempflow": "recipes/tiny/tempflow_flux.yaml",
    "branchgrpo": "recipes/tiny/branchgrpo_flux.yaml",
    "flowgrpo": "recipes/tiny/flowgrpo_flux.yaml",
    "flowgrpo_fast": "recipes/tiny/flowgrpo_fast_flux.yaml",
    "grpo_guard": "recipes/tiny/grpo_guard_flux.yaml",
    "treenft": "recipes/tiny/treenft_flux.yaml",
}


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_two_steps_on_tiny_flux(algorithm: str, tiny_flux_dir: Path, tmp_path: Path) -> None:
    flux = "rlpost.models.flux.FluxPolicy"
    lines, _ = check_recipe_trains_two_steps(ALGORITHMS[algorithm], tiny_flux_dir, tmp_path / "run", "flux", flux)
    if algorithm == "dancegrpo":
        # 2 groups x 4 samples x 4 steps, one forward each (no CFG doubling); 3 SDE steps trained per sample.
        assert lines[0]["perf/rollout_forwards"] == 2 * 4 * 4
        assert lines[0]["train/edges"] == 2 * 4 * 3


def _dance(model: dict[str, Any], **sampler: Any) -> dict[str, Any]:
    cfg = yaml.safe_load((ROOT / ALGORITHMS["dancegrpo"]).read_text())
    cfg["model"] = model
    cfg["sampler"]["init_args"].update(sampler)
    return cfg


def test_sampler_validation_asks_the_adapter_about_its_grid(tiny_flux_dir: Path, tiny_sd3_dir: Path) -> None:
    """DanceGRPO's penultimate SDE step is refused on SD3's diffusers grid (it lands on sigma_min) but allowed on
    FLUX's diffusers grid, which ends shift(1/T) -> 0; DDPO's sampled final step is refused on FLUX's."""
    host = build_host()
    flux = {"class_path": "flux", "init_args": {"pretrained": str(tiny_flux_dir), "resolution": 32}}
    sd3 = {"class_path": "sd3", "init_args": {"pretrained": str(tiny_sd3_dir), "resolution": 32}}
    validate(_dance(flux, penultimate_step="sde"), host)  # time_grid "diffusers" (the default)
    with pytest.raises(RecipeError, match="penultimate_step"):
        validate(_dance(sd3, penultimate_step="sde"), host)
    ddpo = yaml.safe_load((ROOT / ALGORITHMS["ddpo"]).read_text())
    ddpo["model"] = flux
    ddpo["sampler"]["init_args"]["final_step"] = "sde"
    with pytest.raises(RecipeError, match="final_step"):
        validate(ddpo, host)


@pytest.fixture(scope="module")
def flux_lora_run(tmp_path_factory: pytest.TempPathFactory, tiny_flux_dir: Path) -> tuple[Path, PluginHost]:
    host = build_host(load_entrypoints=False, extra_plugins=(toy_components,))
    out = tmp_path_factory.mktemp("flux-export") / "run"
    cfg = {
        "run": {"seed": 0, "output_dir": str(out), "max_steps": 2, "groups_per_step": 1, "samples_per_group": 2,
                "device": "cpu", "progress": False},
        "model": {"class_path": "flux", "init_args": {"pretrained": str(tiny_flux_dir), "dtype": "float32",
                  "resolution": 32, "guidance_scale": 3.5, "max_sequence_length": 32, "lora": {"rank": 4, "alpha": 8}}},
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
    Runner(validate(cfg, host), host).run()
    return out, host


def _eval_images(run: Path, step: int) -> list[np.ndarray]:
    return [np.asarray(Image.open(run / "eval" / f"step_{step:06d}" / f"{i:04d}.png")) for i in range(len(PROMPTS))]


def test_exported_flux_lora_loads_and_reproduces_eval_and_sample(
    flux_lora_run: tuple[Path, PluginHost], tiny_flux_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from diffusers import DiffusionPipeline, FluxPipeline

    run, host = flux_lora_run
    assert cli.main(["export", "--run", str(run), "--out", str(tmp_path / "export")]) == 0
    card = (tmp_path / "export" / "README.md").read_text()
    assert "DiffusionPipeline.from_pretrained" in card and "load_lora_weights" in card
    # Follow the card: DiffusionPipeline resolves the FLUX pipeline class from model_index.json.
    pipe = DiffusionPipeline.from_pretrained(str(tiny_flux_dir), torch_dtype=torch.float32)
    assert isinstance(pipe, FluxPipeline)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(tmp_path / "export"))
    trained, before = _eval_images(run, 2), _eval_images(run, 0)
    assert any(not np.array_equal(a, b) for a, b in zip(trained, before, strict=True)), "training must change images"
    for i, prompt in enumerate(PROMPTS):
        image = pipe(
            prompt, num_inference_steps=3, guidance_scale=3.5, height=32, width=32, max_sequence_length=32,
            generator=torch.Generator().manual_seed(5 + i), output_type="np",
        ).images[0]  # fmt: skip
        assert_pixels_close((image * 255).round().astype(np.uint8), trained[i])
    # rlpost sample rebuilds the FLUX policy from the run's recipe and reproduces the same images.
    monkeypatch.setattr(cli, "get_host", lambda: host)
    args = ["sample", "--run", str(run), "--out", str(tmp_path / "s"), "--num-steps", "3", "--seed", "5"]
    assert cli.main([*args, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1]]) == 0
    for i, expected in enumerate(trained):
        assert_pixels_close(np.asarray(Image.open(tmp_path / "s" / f"{i:04d}.png")), expected)
