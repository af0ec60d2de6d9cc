"""The GPU benchmarks' random-weight FLUX.1 builder (benchmarks/gpu_flux.py), checked at tiny width on CPU.

The speed check itself needs a GPU; this catches the builder breaking (it shares rlpost/models/tiny_text.py's tokenizers
and text encoders and rlpost/models/tiny.py's pipeline assembly) before a GPU session finds out.
"""

from __future__ import annotations

from pathlib import Path

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
