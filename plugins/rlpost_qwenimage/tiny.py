"""A tiny, randomly initialised ``QwenImagePipeline`` with the *real* diffusers/transformers architecture.

Tests and CPU runs need a Qwen-Image model without downloading 20B parameters. :func:`build_tiny_qwenimage` builds
each component from its real class at tiny width, draws random weights under a fixed seed, puts every module in
``eval()`` mode (modules built in code start in train mode; loaded ones do not) and saves the pipeline with
``save_pretrained``, so it is loaded through the production ``QwenImagePipeline.from_pretrained`` path:

* ``QwenImageTransformer2DModel``: Qwen-Image's double-stream MMDiT (two blocks, 2 heads x 8, RoPE axes 2/2/4 summing
  to the head width as the released 16/56/56 sum to 128), taking 2x2-packed latents of 4 channels (16 inputs).
* ``AutoencoderKLQwenImage``: the Wan-style causal 3-D VAE, one down stage (VAE factor 2), 4 latent channels with
  the first four per-channel ``latents_mean`` / ``latents_std`` of the released VAE, so the normalisation is not
  the identity.
* ``Qwen2_5_VLForConditionalGeneration``: the Qwen2.5-VL text encoder (2 decoder layers, width 32, multimodal RoPE
  sections 1/1/2) with a one-block vision tower the class requires (prompts never use it).
* ``Qwen2Tokenizer``: a byte-level BPE learnt locally (:mod:`rlpost_qwenimage.tokenizer`), splitting the pipeline's
  prompt template into the 34 tokens the pipeline drops.
* ``FlowMatchEulerDiscreteScheduler`` with Qwen-Image's configuration (:data:`QWEN_IMAGE_SCHEDULER_CONFIG`).

``QwenImagePolicy(pretrained="tiny-random[:SEED]")`` builds it once into ``$RLPOST_CACHE/tiny-qwenimage-seed<SEED>``
(atomically, :func:`rlpost.ensure_tiny_model`). Command line::

    python -m rlpost_qwenimage.tiny OUT_DIR [--seed 0] [--num-layers 2]
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rlpost import ensure_tiny_model
from rlpost_qwenimage.tokenizer import build_qwen2_tokenizer

__all__ = [
    "QWEN_IMAGE_SCHEDULER_CONFIG",
    "TINY_LATENTS_MEAN",
    "TINY_LATENTS_STD",
    "TINY_VAE_FACTOR",
    "build_tiny_qwenimage",
    "ensure_tiny_qwenimage",
    "main",
]

QWEN_IMAGE_SCHEDULER_CONFIG: Mapping[str, Any] = {
    # Qwen/Qwen-Image, scheduler/scheduler_config.json: FLUX-style dynamic shift (mu linear in the image tokens, from
    # 0.5 at 256 tokens to 0.9 at 8192), exponential time shift, the grid stretched to end at 0.02 before the final 0.
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": False,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}

TINY_LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075)
"""First four channels of the released VAE's ``latents_mean`` (Qwen/Qwen-Image ``vae/config.json``)."""
TINY_LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558)
"""First four channels of the released VAE's ``latents_std``."""

_TINY_TEMPORAL_DOWNSAMPLE = (False,)
TINY_VAE_FACTOR = 2 ** len(_TINY_TEMPORAL_DOWNSAMPLE)
"""Spatial factor of the tiny VAE (``QwenImagePipeline.vae_scale_factor = 2 ** len(vae.temperal_downsample)``)."""


def _text_encoder(tokenizer: Any, hidden: int, num_layers: int) -> Any:
    """A tiny ``Qwen2_5_VLForConditionalGeneration`` over ``tokenizer``'s vocabulary, drawn from the global RNG."""
    transformers: Any = importlib.import_module("transformers")
    token_id = tokenizer.convert_tokens_to_ids
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=37,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention, as Qwen2.5-VL-7B (28 query / 4 key-value heads)
        max_position_embeddings=2048,
        # Multimodal RoPE over (time, height, width) sections summing to half the head width (Qwen2.5-VL: 16/24/24).
        rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 1_000_000.0},
        bos_token_id=None,
        eos_token_id=token_id("<|im_end|>"),
        pad_token_id=token_id("<|endoftext|>"),
    )
    # A one-block vision tower: the class always builds one, and its output width must be the text width.
    vision = dict(
        depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=hidden, fullatt_block_indexes=[0]
    )
    config = transformers.Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=token_id("<|image_pad|>"),
        video_token_id=token_id("<|video_pad|>"),
        vision_start_token_id=token_id("<|vision_start|>"),
        vision_end_token_id=token_id("<|vision_end|>"),
    )
    return transformers.Qwen2_5_VLForConditionalGeneration(config)


def build_tiny_qwenimage(out_dir: Path, *, seed: int = 0, num_layers: int = 2, text_layers: int = 2) -> Path:
    """Build and save a tiny random-weight ``QwenImagePipeline`` (real architecture, under 1 MB).

    Args:
        out_dir: Directory to write the pipeline into (``model_index.json`` plus one subfolder per component).
        seed: Seed for the random weights; the same seed gives the same weights.
        num_layers: Transformer (double-stream) blocks. Two by default: the last block's text-stream output feeds
            nothing (only the image stream reaches ``proj_out``), so with one block no text-side LoRA would train.
        text_layers: Decoder layers of the text encoder.

    Returns:
        ``out_dir``.
    """
    diffusers: Any = importlib.import_module("diffusers")
    out_dir = Path(out_dir)
    tokenizer = build_qwen2_tokenizer()
    hidden = 32  # text-encoder width = the transformer's joint_attention_dim (3584 in Qwen-Image)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = diffusers.QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=16,  # 4 latent channels x 2x2 packing
            out_channels=4,
            num_layers=num_layers,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=hidden,
            axes_dims_rope=(2, 2, 4),
        )
        vae = diffusers.AutoencoderKLQwenImage(
            base_dim=8,
            z_dim=len(TINY_LATENTS_MEAN),
            dim_mult=[1, 2],
            num_res_blocks=1,
            attn_scales=[],
            temperal_downsample=list(_TINY_TEMPORAL_DOWNSAMPLE),
            latents_mean=list(TINY_LATENTS_MEAN),
            latents_std=list(TINY_LATENTS_STD),
        )
        text_encoder = _text_encoder(tokenizer, hidden, text_layers)
    for module in (transformer, vae, text_encoder):
        module.eval()
    pipe = diffusers.QwenImagePipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(str(out_dir))
    return out_dir


def ensure_tiny_qwenimage(seed: int = 0, root: Path | None = None) -> Path:
    """Build the ``tiny-random:<seed>`` Qwen-Image pipeline into the cache once (build, then rename) and return it.

    ``QwenImagePolicy(pretrained="tiny-random")`` loads it through ``QwenImagePipeline.from_pretrained``.
    """
    return ensure_tiny_model("tiny-qwenimage", build_tiny_qwenimage, seed, root)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry: build a tiny Qwen-Image pipeline into a directory."""
    parser = argparse.ArgumentParser(description="Build a tiny random-weight Qwen-Image pipeline (real architecture).")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-layers", type=int, default=2)
    args = parser.parse_args(argv)
    print(build_tiny_qwenimage(args.out_dir, seed=args.seed, num_layers=args.num_layers))


if __name__ == "__main__":
    main()
