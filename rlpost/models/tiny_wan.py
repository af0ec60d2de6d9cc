"""A tiny, randomly initialised Wan2.1 text-to-video pipeline with the *real* diffusers/transformers architecture.

Tests and CPU examples need a video model without downloading weights. :func:`build_tiny_wan` builds a
``WanPipeline`` from the real classes at tiny width: a ``WanTransformer3DModel`` (Wan2.1 T2V's structure: 3-D patch
``(1, 2, 2)``, 3-axis RoPE, self-attention, cross-attention on the text, ``rms_norm_across_heads`` q/k norm), an
``AutoencoderKLWan`` with Wan2.1's *real* compression (spatial factor 8, temporal factor 4, 16 latent channels and
the released ``latents_mean`` / ``latents_std``, which are the class defaults) at base width 4, and a one-layer
``UMT5EncoderModel`` with a locally built Unigram tokenizer (:func:`rlpost.models.tiny.t5_vocab`; the released
model uses google/umt5-xxl's). So the frame-count rule ``num_frames ≡ 1 (mod 4)`` and the size rule (a multiple of
8 x 2 = 16 pixels) are the released model's.

The scheduler is ``FlowMatchEulerDiscreteScheduler(shift=3.0)``, not the ``UniPCMultistepScheduler`` (``flow_shift``
3.0 for 480p) that ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers`` ships: with it ``WanPipeline.__call__`` takes plain Euler
steps, so the adapter's Euler ODE along its ``"diffusers"`` grid can be compared with the pipeline's own output (see
``rlpost/models/wan.py``, :func:`rlpost.models.wan.wan_diffusers_sigmas`).

Every module is put in ``eval()`` mode before saving (see ``rlpost/models/tiny.py``: dropout would break the
save/load round trip), and the result is written with ``save_pretrained``, so ``WanPolicy(pretrained="tiny-random")``
loads it through the production ``WanPipeline.from_pretrained`` path. About 0.3 MB; building takes about 2 s on two
CPU cores.

No command line of its own: ``rlpost/models/tiny.py``'s ``--family`` is the place for one (``wan``) once that module's
split lands.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rlpost.models.tiny import ensure_tiny_model
from rlpost.models.tiny_text import t5_vocab

__all__ = [
    "TINY_WAN_SHIFT",
    "WAN21_UNIPC_SCHEDULER",
    "TINY_WAN_TRANSFORMER",
    "TINY_WAN_VAE",
    "assemble_wan_pipeline",
    "build_tiny_wan",
    "ensure_tiny_wan",
]

TINY_WAN_TRANSFORMER: Mapping[str, Any] = {
    # WanTransformer3DModel at tiny width: Wan2.1-T2V-1.3B has 12 heads x 128, ffn 8960, 30 layers, text_dim 4096.
    "patch_size": (1, 2, 2),
    "num_attention_heads": 2,
    "attention_head_dim": 12,  # RoPE splits it 4 (frames) / 4 (rows) / 4 (columns), as 128 splits 44 / 42 / 42
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 32,  # the UMT5 width below
    "freq_dim": 32,
    "ffn_dim": 32,
    "num_layers": 2,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 32,  # at most 32 latent frames / patch rows / patch columns (512 px, 125 frames)
}
"""Transformer config of the tiny Wan (``validate`` reads ``patch_size`` and ``rope_max_seq_len`` from it)."""

TINY_WAN_VAE: Mapping[str, Any] = {
    # AutoencoderKLWan: Wan2.1's 4 levels (spatial factor 8) and temporal downsampling in the last two (factor 4),
    # at base width 4 instead of 96; z_dim, latents_mean and latents_std are the class defaults, Wan2.1's values.
    "base_dim": 4,
    "z_dim": 16,
    "dim_mult": [1, 1, 1, 1],
    "num_res_blocks": 1,
    "temperal_downsample": [False, True, True],
    "scale_factor_temporal": 4,
    "scale_factor_spatial": 8,
}
"""VAE config of the tiny Wan (``validate`` reads the two scale factors from it)."""

TINY_WAN_SHIFT = 3.0
"""Static shift of the tiny scheduler: the released 480p ``flow_shift``."""

WAN21_UNIPC_SCHEDULER: Mapping[str, Any] = {
    # Wan-AI/Wan2.1-T2V-1.3B-Diffusers, scheduler/scheduler_config.json (the fields that are not UniPC's defaults)
    "_class_name": "UniPCMultistepScheduler",
    "flow_shift": 3.0,
    "prediction_type": "flow_prediction",
    "use_flow_sigmas": True,
    "final_sigmas_type": "zero",
    "solver_order": 2,
    "solver_type": "bh2",
}
"""The released Wan2.1 scheduler (480p), which the tiny build replaces by a flow-match Euler one (module docstring);
benchmarks/gpu_wan.py's random Wan2.1-1.3B keeps it."""


def assemble_wan_pipeline(transformer: Any, vae: Any, text_encoder: Any, tokenizer: Any, scheduler: Any) -> Any:
    """A ``WanPipeline`` of these modules, each put in ``eval()`` mode first (dropout would break the save/load round
    trip, see ``rlpost/models/tiny.py``)."""
    diffusers: Any = importlib.import_module("diffusers")
    for module in (transformer, vae, text_encoder):
        module.eval()
    return diffusers.WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler, transformer=transformer
    )


def build_tiny_wan(out_dir: Path, *, seed: int = 0, num_layers: int | None = None) -> Path:
    """Build and save a tiny random-weight ``WanPipeline`` (real Wan2.1 T2V architecture, about 0.3 MB).

    Args:
        out_dir: Directory to write the pipeline into (``model_index.json`` plus one subfolder per component).
        seed: Seed for the random weights; the same seed gives the same weights.
        num_layers: Transformer blocks (default :data:`TINY_WAN_TRANSFORMER`'s 2).

    Returns:
        ``out_dir``.
    """
    # diffusers/transformers are untyped for mypy; build through Any-typed module handles.
    diffusers: Any = importlib.import_module("diffusers")
    transformers: Any = importlib.import_module("transformers")

    out_dir = Path(out_dir)
    tokenizer = transformers.T5Tokenizer(vocab=t5_vocab(), extra_ids=0, model_max_length=512)
    transformer_cfg = dict(TINY_WAN_TRANSFORMER)
    if num_layers is not None:
        transformer_cfg["num_layers"] = num_layers
    # Build on CPU in fp32 under a fixed seed (module constructors draw from the global RNG).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = diffusers.WanTransformer3DModel(**transformer_cfg)
        vae = diffusers.AutoencoderKLWan(**TINY_WAN_VAE)
        text_config = transformers.UMT5Config(
            vocab_size=len(tokenizer),
            d_model=int(TINY_WAN_TRANSFORMER["text_dim"]),
            d_kv=8,
            d_ff=37,
            num_layers=1,
            num_heads=4,
            relative_attention_num_buckets=8,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        )
        text_encoder = transformers.UMT5EncoderModel(text_config)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=TINY_WAN_SHIFT)
    pipe = assemble_wan_pipeline(transformer, vae, text_encoder, tokenizer, scheduler)
    out_dir.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(str(out_dir))
    return out_dir


def ensure_tiny_wan(seed: int = 0, root: Path | None = None) -> Path:
    """Build the ``tiny-random:<seed>`` Wan pipeline (:func:`build_tiny_wan`) into the cache once (atomically:
    build, then rename) and return it.

    ``WanPolicy(pretrained="tiny-random")`` loads it through ``WanPipeline.from_pretrained``.
    """
    return ensure_tiny_model("tiny-wan", build_tiny_wan, seed, root)
