"""A random-weight pipeline of the Wan2.1-T2V-1.3B architecture, for GPU speed checks without downloads.

    python benchmarks/gpu_speed.py build --family wan --model-dir DIR

The transformer is exactly Wan2.1-T2V-1.3B's ``transformer/config.json`` (``WanTransformer3DModel``: 30 blocks, 12
heads x 128 = width 1536, FFN 8960, frequency embedding 256, 3-D patch (1, 2, 2), RMS q/k norm across heads,
cross-attention norm, text width 4096, RoPE table 1024; 1.3B parameters) and the VAE Wan2.1's (``AutoencoderKLWan``:
base width 96, multipliers 1/2/4/4, two residual blocks per level, temporal downsampling in the last two levels: a
factor 4 in time and 8 in space, 16 latent channels with the released ``latents_mean`` / ``latents_std``; these are
the class defaults). The scheduler is the released ``UniPCMultistepScheduler`` configuration (flow sigmas,
``flow_shift`` 3.0 for 480p). Speed does not depend on weight values. The text encoder keeps UMT5-XXL's output width
(4096, 512 tokens) but one layer: the policy encodes each prompt once and caches it, so encoder depth never enters an
iteration's time.

Sources: ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers`` ``transformer/config.json``, ``vae/config.json`` and
``scheduler/scheduler_config.json`` (the values restated below and, for the scheduler, in
:data:`rlpost.models.tiny_wan.WAN21_UNIPC_SCHEDULER`; the transformer's also match the Wan team's
``wan/configs/wan_t2v_1_3B.py``: dim 1536, ffn_dim 8960, freq_dim 256, 12 heads, 30 layers).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch

from rlpost.models.tiny_text import t5_vocab
from rlpost.models.tiny_wan import WAN21_UNIPC_SCHEDULER, assemble_wan_pipeline

WAN21_T2V_1_3B_TRANSFORMER: dict[str, Any] = {
    # Wan-AI/Wan2.1-T2V-1.3B-Diffusers, transformer/config.json
    "patch_size": (1, 2, 2),
    "num_attention_heads": 12,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 8960,
    "num_layers": 30,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "image_dim": None,
    "added_kv_proj_dim": None,
    "rope_max_seq_len": 1024,
}
WAN21_VAE: dict[str, Any] = {
    # Wan-AI/Wan2.1-T2V-1.3B-Diffusers, vae/config.json (latents_mean / latents_std: AutoencoderKLWan's defaults)
    "base_dim": 96,
    "z_dim": 16,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "dropout": 0.0,
}
UMT5_XXL_WIDTH: dict[str, Any] = {
    # google/umt5-xxl's encoder widths (what the transformer's text_dim 4096 reads), one layer instead of 24
    "d_model": 4096,
    "d_kv": 64,
    "d_ff": 10240,
    "num_heads": 64,
    "num_layers": 1,
    "relative_attention_num_buckets": 32,
}


def build_random_wan21(
    out_dir: Path,
    num_layers: int | None = None,
    device: str = "cuda",
    overrides: dict[str, dict[str, Any]] | None = None,
) -> Path:
    """Save a random-weight ``WanPipeline`` of the Wan2.1-T2V-1.3B architecture (bf16 transformer).

    Args:
        out_dir: Target directory (reused when ``model_index.json`` exists).
        num_layers: Override the transformer depth (smoke tests only; ``None`` = Wan2.1-1.3B's 30).
        device: Where to initialise the weights.
        overrides: Per-component config overrides (``{"transformer": {...}, "vae": {...}, "umt5": {...}}``) for
            plumbing checks at small width; a speed check passes none.
    """
    if (out_dir / "model_index.json").is_file():
        return out_dir
    diffusers: Any = importlib.import_module("diffusers")
    transformers: Any = importlib.import_module("transformers")

    overrides = overrides or {}
    cfg = dict(WAN21_T2V_1_3B_TRANSFORMER) | overrides.get("transformer", {})
    if num_layers is not None:
        cfg["num_layers"] = num_layers
    tokenizer = transformers.T5Tokenizer(vocab=t5_vocab(), extra_ids=0, model_max_length=512)
    umt5 = dict(UMT5_XXL_WIDTH) | overrides.get("umt5", {})
    torch.manual_seed(0)
    with torch.device(device):
        transformer = diffusers.WanTransformer3DModel(**cfg).to(torch.bfloat16)
        vae = diffusers.AutoencoderKLWan(**(WAN21_VAE | overrides.get("vae", {})))
        text_encoder = transformers.UMT5EncoderModel(
            transformers.UMT5Config(
                vocab_size=len(tokenizer), decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, **umt5
            )
        )
    scheduler_config = {k: v for k, v in WAN21_UNIPC_SCHEDULER.items() if k != "_class_name"}
    scheduler = diffusers.UniPCMultistepScheduler(num_train_timesteps=1000, **scheduler_config)
    pipe = assemble_wan_pipeline(transformer, vae, text_encoder, tokenizer, scheduler)
    out_dir.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(str(out_dir))
    return out_dir
