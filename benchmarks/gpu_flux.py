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
import tempfile
from pathlib import Path
from typing import Any

import torch

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
FLUX1_VAE: dict[str, Any] = {
    # black-forest-labs/FLUX.1-dev, vae/config.json
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "latent_channels": 16,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}
FLUX1_SCHEDULER: dict[str, Any] = {
    # black-forest-labs/FLUX.1-dev, scheduler/scheduler_config.json
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}


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
    transformers: Any = importlib.import_module("transformers")
    from rlpost.models.tiny import _t5_vocab, write_clip_tokenizer_files

    overrides = overrides or {}
    cfg = dict(FLUX1_DEV_TRANSFORMER) | overrides.get("transformer", {})
    if num_layers is not None:
        cfg["num_layers"] = num_layers
    if num_single_layers is not None:
        cfg["num_single_layers"] = num_single_layers
    with tempfile.TemporaryDirectory() as tmp:
        vocab = write_clip_tokenizer_files(Path(tmp), 1000)
        clip_tok = transformers.CLIPTokenizer(
            vocab=str(Path(tmp) / "vocab.json"), merges=str(Path(tmp) / "merges.txt"), model_max_length=77
        )
    t5_tok = transformers.T5Tokenizer(vocab=_t5_vocab(), extra_ids=0, model_max_length=512)
    clip_cfg = {"hidden_size": cfg["pooled_projection_dim"], "num_attention_heads": 12} | overrides.get("clip", {})
    t5_cfg = {"d_model": cfg["joint_attention_dim"], "d_kv": 64, "d_ff": 10240, "num_heads": 64} | overrides.get(
        "t5", {}
    )
    torch.manual_seed(0)
    with torch.device(device):
        transformer = diffusers.FluxTransformer2DModel(**cfg).to(torch.bfloat16)
        vae = diffusers.AutoencoderKL(**(FLUX1_VAE | overrides.get("vae", {})))
        te1 = transformers.CLIPTextModel(
            transformers.CLIPTextConfig(
                bos_token_id=vocab - 2,
                eos_token_id=vocab - 1,
                pad_token_id=vocab - 1,
                intermediate_size=4 * clip_cfg["hidden_size"],
                num_hidden_layers=1,
                vocab_size=vocab,
                max_position_embeddings=77,
                hidden_act="gelu",
                **clip_cfg,
            )
        )
        te2 = transformers.T5EncoderModel(
            transformers.T5Config(
                vocab_size=len(t5_tok),
                num_layers=1,
                decoder_start_token_id=0,
                pad_token_id=0,
                eos_token_id=1,
                **t5_cfg,
            )
        )
    for m in (transformer, vae, te1, te2):
        m.eval()
    pipe = diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(**FLUX1_SCHEDULER),
        vae=vae,
        text_encoder=te1,
        tokenizer=clip_tok,
        text_encoder_2=te2,
        tokenizer_2=t5_tok,
        transformer=transformer,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(str(out_dir))
    return out_dir
