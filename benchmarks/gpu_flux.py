"""A random-weight pipeline of the FLUX.1-dev architecture, for GPU speed checks without downloads.

    python benchmarks/gpu_speed.py build --family flux --model-dir DIR

The transformer is exactly FLUX.1-dev's ``transformer/config.json`` (19 double-stream and 38 single-stream blocks,
24 heads x 128, guidance embedding, 3-axis RoPE 16/56/56, 64 packed input channels: 12B parameters, 24 GB in bf16)
and the VAE FLUX.1's (16 latent channels, factor 8, scaling 0.3611, shift 0.1159). The scheduler is FLUX.1-dev's
dynamic-shift configuration. Speed does not depend on weight values. The text encoders keep FLUX.1's output widths
(CLIP-L pooled 768, T5-XXL 4096, so the transformer sees the same 512 context tokens) but one layer each: the policy
encodes each prompt once and caches it, so encoder depth never enters an iteration's time.

Sources: ``black-forest-labs/FLUX.1-dev`` ``transformer/config.json``, ``vae/config.json`` and
``scheduler/scheduler_config.json`` (the values restated below).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch
from gpu_sd35 import SD35_VAE  # benchmarks/ is not a package: gpu_speed.py puts it on sys.path

from rlpost.models.tiny import FLUX1_SCHEDULER_CONFIG, assemble_flux_pipeline
from rlpost.models.tiny_text import flux_text_encoders, sd3_tokenizers

FLUX1_DEV_TRANSFORMER: dict[str, Any] = {
    # black-forest-labs/FLUX.1-dev, transformer/config.json
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}
FLUX1_VAE: dict[str, Any] = SD35_VAE | {
    # black-forest-labs/FLUX.1-dev, vae/config.json: SD3.5's VAE architecture with FLUX.1's latent constants
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
}
FLUX1_SCHEDULER: dict[str, Any] = {"num_train_timesteps": 1000, **FLUX1_SCHEDULER_CONFIG}
"""black-forest-labs/FLUX.1-dev, scheduler/scheduler_config.json (rlpost/models/tiny.py restates it)."""


def build_random_flux1(
    out_dir: Path,
    num_layers: int | None = None,
    num_single_layers: int | None = None,
    device: str = "cuda",
    overrides: dict[str, dict[str, Any]] | None = None,
) -> Path:
    """Save a random-weight ``FluxPipeline`` of the FLUX.1-dev architecture (bf16 transformer).

    Args:
        out_dir: Target directory (reused when ``model_index.json`` exists).
        num_layers: Override the double-stream depth (smoke tests only; ``None`` = FLUX.1-dev's 19).
        num_single_layers: Override the single-stream depth (``None`` = 38).
        device: Where to initialise the weights (GPU init of 12B parameters takes seconds; CPU many minutes).
        overrides: Per-component config overrides (``{"transformer": {...}, "vae": {...}, "t5": {...},
            "clip": {...}}``) for plumbing checks at small width; a speed check passes none.
    """
    if (out_dir / "model_index.json").is_file():
        return out_dir
    diffusers: Any = importlib.import_module("diffusers")

    overrides = overrides or {}
    cfg = dict(FLUX1_DEV_TRANSFORMER) | overrides.get("transformer", {})
    if num_layers is not None:
        cfg["num_layers"] = num_layers
    if num_single_layers is not None:
        cfg["num_single_layers"] = num_single_layers
    clip_tok, vocab, t5_tok = sd3_tokenizers(clip_merges=1000, clip_max_length=77, t5_max_length=512)
    clip_cfg = {"hidden_size": cfg["pooled_projection_dim"], "num_attention_heads": 12} | overrides.get("clip", {})
    clip_cfg = {"intermediate_size": 4 * clip_cfg["hidden_size"], "num_hidden_layers": 1} | clip_cfg
    t5_cfg = {"d_model": cfg["joint_attention_dim"], "d_kv": 64, "d_ff": 10240, "num_heads": 64} | overrides.get(
        "t5", {}
    )
    t5_cfg = {"relative_attention_num_buckets": 32} | t5_cfg  # transformers' T5Config default
    torch.manual_seed(0)
    with torch.device(device):
        transformer = diffusers.FluxTransformer2DModel(**cfg).to(torch.bfloat16)
        vae = diffusers.AutoencoderKL(**(FLUX1_VAE | overrides.get("vae", {})))
        te1, te2 = flux_text_encoders(vocab, len(t5_tok), clip_overrides=(clip_cfg, clip_cfg), t5_overrides=t5_cfg)
    pipe = assemble_flux_pipeline(transformer, vae, (te1, te2), clip_tok, t5_tok, FLUX1_SCHEDULER)
    out_dir.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(str(out_dir))
    return out_dir
