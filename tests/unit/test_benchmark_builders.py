"""The GPU benchmarks' random-weight FLUX.1 and Wan2.1 builders (benchmarks/gpu_flux.py, gpu_wan.py), checked at tiny
width on CPU, and the GPU check's arms (benchmarks/gpu_speed.py) validated as recipes.

The speed check itself needs a GPU; this catches the builder breaking (it shares rlpost/models/tiny_text.py's tokenizers
and text encoders and rlpost/models/tiny.py's pipeline assembly) before a GPU session finds out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

NARROW = {
    "transformer": {
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "joint_attention_dim": 64,
        "pooled_projection_dim": 32,
        "axes_dims_rope": (4, 6, 6),
    },
    "vae": {"block_out_channels": [8, 8, 8, 8], "norm_num_groups": 4},
    "t5": {"d_model": 64, "d_ff": 64, "num_heads": 2, "d_kv": 8},
    "clip": {"num_attention_heads": 2},
}


def test_random_flux1_builder_saves_a_loadable_flux1_shaped_pipeline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from diffusers import FluxPipeline

    monkeypatch.syspath_prepend(str(BENCHMARKS))  # benchmarks/ is not a package (as gpu_speed.py does)
    from gpu_flux import build_random_flux1

    out = build_random_flux1(tmp_path / "flux", num_layers=1, num_single_layers=1, device="cpu", overrides=NARROW)
    pipe = FluxPipeline.from_pretrained(str(out))
    assert type(pipe.text_encoder).__name__ == "CLIPTextModel"  # pooled output, no projection (FLUX.1's CLIP-L)
    assert pipe.text_encoder.config.hidden_size == 32 == pipe.transformer.config.pooled_projection_dim
    assert pipe.text_encoder.config.num_hidden_layers == 1
    assert pipe.text_encoder_2.config.d_model == 64 == pipe.transformer.config.joint_attention_dim
    assert pipe.tokenizer_2.model_max_length == 512
    assert pipe.scheduler.config.use_dynamic_shifting and pipe.scheduler.config.max_shift == 1.15
    assert (pipe.vae.config.scaling_factor, pipe.vae.config.shift_factor) == (0.3611, 0.1159)
    assert pipe.vae.config.latent_channels == 16 and pipe.vae_scale_factor == 8
    latents = pipe(
        "a red cat", num_inference_steps=1, height=64, width=64, max_sequence_length=16, output_type="latent"
    ).images
    assert latents.shape == (1, 16, 64)  # (64/8/2)^2 packed tokens of 4 x 16 channels


NARROW_WAN = {
    "transformer": {
        "num_attention_heads": 2,
        "attention_head_dim": 12,  # RoPE splits it 4 / 4 / 4 (frames, rows, columns) as the tiny Wan does
        "text_dim": 32,
        "freq_dim": 32,
        "ffn_dim": 32,
    },
    "vae": {"base_dim": 4, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1},
    "umt5": {"d_model": 32, "d_kv": 8, "d_ff": 37, "num_heads": 4, "relative_attention_num_buckets": 8},
}


@pytest.fixture(scope="module")
def narrow_wan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """benchmarks/gpu_wan.py's random Wan2.1-T2V-1.3B builder at tiny width (one block)."""
    import sys

    sys.path.insert(0, str(BENCHMARKS))
    try:
        from gpu_wan import build_random_wan21
    finally:
        sys.path.remove(str(BENCHMARKS))
    return build_random_wan21(tmp_path_factory.mktemp("wan") / "pipe", num_layers=1, device="cpu", overrides=NARROW_WAN)


def test_random_wan21_builder_saves_a_loadable_wan21_shaped_pipeline(narrow_wan: Path) -> None:
    """Everything but the narrowed widths is Wan2.1-T2V-1.3B's: 3-D patch, q/k norm, RoPE table, the VAE's 8x / 4x
    compression and latent statistics, UMT5's 512 tokens, the released UniPC flow schedule; WanPolicy takes it."""
    import torch
    from diffusers import WanPipeline

    from rlpost.models.wan import WanPolicy

    pipe = WanPipeline.from_pretrained(str(narrow_wan))
    t = pipe.transformer.config
    assert tuple(t.patch_size) == (1, 2, 2) and t.qk_norm == "rms_norm_across_heads" and t.cross_attn_norm
    assert (t.in_channels, t.out_channels, t.rope_max_seq_len, t.num_layers) == (16, 16, 1024, 1)
    assert pipe.vae_scale_factor_spatial == 8 and pipe.vae_scale_factor_temporal == 4 and pipe.vae.config.z_dim == 16
    assert pipe.vae.config.latents_mean[0] == -0.7571 and pipe.vae.config.latents_std[0] == 2.8184
    assert pipe.text_encoder.config.num_layers == 1 and pipe.text_encoder.config.d_model == t.text_dim
    assert pipe.tokenizer.model_max_length == 512
    s = pipe.scheduler.config
    assert type(pipe.scheduler).__name__ == "UniPCMultistepScheduler" and s.use_flow_sigmas and s.flow_shift == 3.0
    policy = WanPolicy(str(narrow_wan), dtype="float32", height=480, width=832, num_frames=33, max_sequence_length=16)
    policy.setup(torch.device("cpu"))
    assert policy.latent_shape == (16, 9, 60, 104)  # 33 frames -> 9 latent frames; 480 x 832 px -> 60 x 104
    sigmas = policy.sigmas(10)
    assert float(sigmas[0]) == 1.0 and float(sigmas[-1]) == 0.0


def _gpu_speed() -> object:
    import importlib
    import sys

    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module("gpu_speed")
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_arm_names() -> None:
    gpu_speed: Any = _gpu_speed()
    assert gpu_speed.parse_arm("treegrpo-paper") == ("treegrpo-paper", False, None)
    assert gpu_speed.parse_arm("dancegrpo+fast@32") == ("dancegrpo", True, 32)
    for bad in ("treegrpo", "dancegrpo+slow", "dancegrpo@many"):
        with pytest.raises(ValueError, match="PRESET"):
            gpu_speed.parse_arm(bad)


def test_gpu_presets_validate(narrow_wan: Path, tiny_sd3_dir: Path, tmp_path: Path) -> None:
    """The GPU check's arms are valid recipes (no weights load): SD3.5 arms with the speed-ups and the paper's 32
    prompts, and the Wan arms at 33 x 480 x 832 with their smaller rows per forward and minibatch."""
    from rlpost.apps.host import build_host
    from rlpost.engine.recipe import validate

    gpu_speed: Any = _gpu_speed()
    host = build_host()
    fast = validate(
        gpu_speed.preset_config("treegrpo-paper+fast@32", str(tiny_sd3_dir), 1, 2, str(tmp_path / "a"), "cpu", 32),
        host,
    )
    assert fast.run.groups_per_step == 32 and fast.run.speedups.compile == "both"
    assert fast.run.speedups.vae_channels_last and fast.sampler.chunk_size == 32  # the shipped recipe's chunking
    assert fast.counts().images == 32 * 27
    plain = validate(
        gpu_speed.preset_config("dancegrpo", str(tiny_sd3_dir), 2, 2, str(tmp_path / "b"), "cpu", 32), host
    )
    assert plain.run.speedups.enabled() == [] and plain.run.groups_per_step == 2
    for arm in ("treegrpo-wan", "dancegrpo-wan+fast"):
        recipe = validate(gpu_speed.preset_config(arm, str(narrow_wan), 1, 2, str(tmp_path / arm), "cpu"), host)
        model: Any = recipe.model
        assert (model.name, model.num_frames, model.height, model.width) == ("wan", 33, 480, 832)
        assert model.guidance_scale == 5.0 and model.full_finetune and model.gradient_checkpointing
        assert recipe.sampler.chunk_size == 4 and recipe.optimizer.minibatch_edges == 3


@pytest.mark.parametrize(
    "arm", ["flowgrpo", "flowgrpo-fast", "grpo-guard", "branchgrpo", "tempflow", "nft", "awm", "dgpo", "treenft"]
)
def test_field_arms_validate(arm: str, tiny_sd3_dir: Path, tmp_path: Path) -> None:
    """Every field arm is its shipped SD3.5 preset with the GPU check's substitutions and validates without loading
    weights; its images and training rows per iteration follow from its own sampler and update rule."""
    from rlpost.apps.host import build_host
    from rlpost.engine.recipe import validate

    gpu_speed: Any = _gpu_speed()
    assert arm in gpu_speed.FIELD_ARMS
    recipe = validate(
        gpu_speed.preset_config(arm, str(tiny_sd3_dir), 1, 2, str(tmp_path / arm), "cpu", 32), host=build_host()
    )
    assert recipe.run.groups_per_step == 1 and recipe.run.max_steps == 2
    assert [r.name for r in recipe.rewards] == ["jpeg-compressibility"]
    counts, train = recipe.counts(), recipe.train_counts()
    assert counts.images > 0 and counts.rollout_forwards > 0 and train.grad_rows > 0


def _record(arm: str, s_iter: float, guard: float | None = None) -> dict[str, Any]:
    gpu_speed: Any = _gpu_speed()
    preset, fast, _ = gpu_speed.parse_arm(arm)
    check = {"max_error": guard} if guard is not None else None
    steps = [{"perf/rollout_sec": 1.0, "perf/update_sec": 2.0}] * 3
    return {
        "preset": arm,
        "base_preset": preset,
        "label": gpu_speed.PRESETS[preset]["label"] + (" + speed-ups" if fast else ""),
        "speedups": ["compile=both (regional, mode default)"] if fast else [],
        "ratio_check": check,
        "first_ratio_dev": 1e-6,
        "groups_per_step": 1,
        "images_per_iter": 12,
        "s_per_iter_mean": s_iter,
        "s_per_iter_min": s_iter,
        "s_per_iter_max": s_iter,
        "setup_s": 30.0,
        "peak_rollout_gib": 20.0,
        "peak_update_gib": 25.0,
        "steps": steps,
        "device": "NVIDIA H200",
        "torch": "2.x",
    }


def test_gpu_report_rows_ratios_and_what_the_speedups_bought() -> None:
    gpu_speed: Any = _gpu_speed()
    records = [
        _record("dancegrpo", 6.0),
        _record("treegrpo-paper", 4.0),
        _record("dancegrpo+fast", 4.0, guard=2e-5),
        _record("treegrpo-paper+fast", 2.0, guard=3e-5),
        {"preset": "treegrpo-wan", "label": "TreeGRPO on Wan", "skipped": "needs the media contract"},
    ]
    text = "\n".join(gpu_speed.report_lines(records))
    assert "| `treegrpo-paper+fast` | TreeGRPO (paper preset) + speed-ups | compile=both" in text
    assert "| 3e-05 | 1e-06 | 20.0 / 25.0 | 72.0 |" in text
    assert "- DanceGRPO / TreeGRPO (paper preset) s/iter: **1.50x**" in text
    assert "- DanceGRPO / TreeGRPO (paper preset) + speed-ups s/iter: **2.00x**" in text
    assert "- speed-ups on `treegrpo-paper`: 2.00x s/iter" in text and "- speed-ups on `dancegrpo`: 1.50x" in text
    assert "| `treegrpo-wan` | TreeGRPO on Wan | skipped: needs the media contract |" in text
