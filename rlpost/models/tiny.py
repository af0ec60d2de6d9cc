"""Tiny, randomly initialised SD3 and FLUX.1 pipelines with the *real* diffusers/transformers architecture.

Tests, examples and CPU benchmarks need an SD3 model without downloading weights. :func:`build_tiny_sd3` builds a
``StableDiffusion3Pipeline`` from small configs (VAE scale factor 2, patch 2, ``pos_embed_max_size`` small, so the
positional-embedding buffer does not dominate the file), with tokenizers made locally and tiny text encoders
(:mod:`rlpost.models.tiny_text`).

Every module is put in ``eval()`` mode before saving: modules built in code start in train mode and CLIP/T5 dropout
would then make outputs differ from the same pipeline loaded back with ``from_pretrained`` (which loads in eval mode;
``tests/unit/models/test_tiny.py`` checks that the saved modules load in eval mode).
The result is written with ``save_pretrained`` so callers load it through the production ``from_pretrained`` path.

Command line::

    python -m rlpost.models.tiny OUT_DIR [--seed 0] [--sample-size 32] [--family sd3|flux]

:func:`build_tiny_flux` builds a ``FluxPipeline`` the same way (FLUX.1-dev's transformer structure at tiny width).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.resources
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rlpost.models.tiny_text import build_text_encoders, flux_text_encoders, sd3_tokenizers

__all__ = [
    "TINY_SAMPLE_SIZE",
    "TINY_SD3_GEOMETRY",
    "TINY_VAE_FACTOR",
    "assemble_sd3_pipeline",
    "build_tiny_flux",
    "build_tiny_sd3",
    "ensure_tiny_flux",
    "ensure_tiny_model",
    "main",
]

TINY_SAMPLE_SIZE = 32
"""Default image size of the tiny pipelines (the transformer's ``sample_size`` and ``pos_embed_max_size`` follow)."""
TINY_VAE_BLOCKS = 2
TINY_SD3_PATCH = 2
TINY_VAE_FACTOR = 2 ** (TINY_VAE_BLOCKS - 1)
"""VAE scale factor of the tiny SD3 and FLUX pipelines ``tiny-random`` builds (``2 ** (vae_blocks - 1)``)."""
TINY_SD3_GEOMETRY = (TINY_VAE_FACTOR, TINY_SD3_PATCH, TINY_SAMPLE_SIZE // TINY_VAE_FACTOR // TINY_SD3_PATCH)
"""``(VAE factor, patch size, pos_embed_max_size)`` of the tiny SD3 ``tiny-random`` builds (:func:`build_tiny_sd3`'s
defaults): what ``validate`` checks a resolution against before the model is built."""


def assemble_sd3_pipeline(
    transformer: Any, vae: Any, text_encoders: Sequence[Any], clip_tokenizer: Any, t5_tokenizer: Any, shift: float
) -> Any:
    """A ``StableDiffusion3Pipeline`` from built modules (both CLIP encoders share ``clip_tokenizer``), every module
    put in ``eval()`` mode first (modules built in code start in train mode; see the module docstring)."""
    diffusers: Any = importlib.import_module("diffusers")
    te1, te2, te3 = text_encoders
    for module in (transformer, te1, te2, te3, vae):
        module.eval()
    return diffusers.StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=shift),
        vae=vae,
        text_encoder=te1,
        tokenizer=clip_tokenizer,
        text_encoder_2=te2,
        tokenizer_2=clip_tokenizer,
        text_encoder_3=te3,
        tokenizer_3=t5_tokenizer,
    )


FLUX1_SCHEDULER_CONFIG: Mapping[str, Any] = {
    # black-forest-labs/FLUX.1-dev, scheduler/scheduler_config.json (dynamic shifting over 256..4096 image tokens)
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}


def assemble_flux_pipeline(
    transformer: Any,
    vae: Any,
    text_encoders: Sequence[Any],
    clip_tokenizer: Any,
    t5_tokenizer: Any,
    scheduler_config: Mapping[str, Any],
) -> Any:
    """A ``FluxPipeline`` from built modules (CLIP then T5 encoder) and ``FlowMatchEulerDiscreteScheduler`` settings,
    every module put in ``eval()`` mode first (see the module docstring: dropout breaks the save/load round trip)."""
    diffusers: Any = importlib.import_module("diffusers")
    te1, te2 = text_encoders
    for module in (transformer, te1, te2, vae):
        module.eval()
    return diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(**scheduler_config),
        vae=vae,
        text_encoder=te1,
        tokenizer=clip_tokenizer,
        text_encoder_2=te2,
        tokenizer_2=t5_tokenizer,
        transformer=transformer,
    )


def tiny_vae(sample_size: int, vae_blocks: int, *, shift_factor: float, scaling_factor: float) -> Any:
    """A tiny ``AutoencoderKL`` (4 latent channels, width 4, scale factor ``2**(vae_blocks-1)``) with the family's
    latent ``shift_factor`` / ``scaling_factor``, drawn from the global torch RNG (callers seed it)."""
    diffusers: Any = importlib.import_module("diffusers")
    return diffusers.AutoencoderKL(
        sample_size=sample_size,
        in_channels=3,
        out_channels=3,
        block_out_channels=(4,) * vae_blocks,
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=1,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=shift_factor,
        scaling_factor=scaling_factor,
        down_block_types=("DownEncoderBlock2D",) * vae_blocks,
        up_block_types=("UpDecoderBlock2D",) * vae_blocks,
    )


def build_tiny_sd3(
    out_dir: Path,
    *,
    seed: int = 0,
    sample_size: int = TINY_SAMPLE_SIZE,
    num_layers: int = 1,
    patch_size: int = TINY_SD3_PATCH,
    vae_blocks: int = TINY_VAE_BLOCKS,
    clip_merges: int = 1000,
    shift: float = 3.0,
) -> Path:
    """Build and save a tiny random-weight ``StableDiffusion3Pipeline`` (real architecture, ~2.5 MB).

    Args:
        out_dir: Directory to write the pipeline into (``model_index.json`` plus one subfolder per component).
        seed: Seed for the random weights; the same seed gives identical files' weights.
        sample_size: Default image size in pixels (the transformer's ``sample_size`` is in latent pixels and
            ``pos_embed_max_size`` is sized to it).
        num_layers: Transformer blocks.
        patch_size: Transformer patch size.
        vae_blocks: VAE encoder/decoder blocks; the VAE scale factor is ``2**(vae_blocks-1)``.
        clip_merges: BPE merges kept in the CLIP tokenizer.
        shift: Static time shift stored in the scheduler config.

    Returns:
        ``out_dir``.
    """
    # diffusers/transformers are untyped for mypy; build through Any-typed module handles.
    diffusers: Any = importlib.import_module("diffusers")

    out_dir = Path(out_dir)
    vae_scale = 2 ** (vae_blocks - 1)
    latent_size = sample_size // vae_scale
    # model_max_length 77: the pipeline pads/truncates CLIP prompts to the tokenizer's max length.
    clip_tok, vocab_size, t5_tok = sd3_tokenizers(clip_merges=clip_merges, clip_max_length=77, t5_max_length=256)

    # Build everything on CPU in fp32 under a fixed seed (module constructors draw from the global RNG).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = diffusers.SD3Transformer2DModel(
            sample_size=latent_size,
            patch_size=patch_size,
            in_channels=4,
            num_layers=num_layers,
            attention_head_dim=8,
            num_attention_heads=4,
            caption_projection_dim=32,
            joint_attention_dim=32,
            pooled_projection_dim=64,
            out_channels=4,
            pos_embed_max_size=max(latent_size // patch_size, 1),
        )
        te1, te2, te3 = build_text_encoders(vocab_size, len(t5_tok))
        vae = tiny_vae(sample_size, vae_blocks, shift_factor=0.0609, scaling_factor=1.5035)
    pipe = assemble_sd3_pipeline(transformer, vae, (te1, te2, te3), clip_tok, t5_tok, shift)
    out_dir.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(str(out_dir))
    return out_dir


def build_tiny_flux(
    out_dir: Path,
    *,
    seed: int = 0,
    sample_size: int = TINY_SAMPLE_SIZE,
    num_layers: int = 1,
    num_single_layers: int = 1,
    vae_blocks: int = TINY_VAE_BLOCKS,
    clip_merges: int = 1000,
    guidance_embeds: bool = True,
) -> Path:
    """Build and save a tiny random-weight ``FluxPipeline`` (real FLUX.1 architecture, about 1 MB).

    The transformer is a ``FluxTransformer2DModel`` with FLUX.1-dev's structure (double-stream then single-stream
    blocks, 3-axis RoPE, the guidance embedding of the guidance-distilled dev model) at tiny width; the VAE has
    4 latent channels, so the 2x2-packed transformer input has 16 channels. Text encoders are a ``CLIPTextModel``
    (pooled output) and a ``T5EncoderModel`` with the locally built tokenizers of :func:`build_tiny_sd3`. The
    scheduler uses FLUX.1's dynamic shifting configuration (``use_dynamic_shifting``, base/max shift 0.5/1.15 over
    256..4096 image tokens, as in ``black-forest-labs/FLUX.1-dev`` ``scheduler/scheduler_config.json``).

    Args:
        out_dir: Directory to write the pipeline into.
        seed: Seed for the random weights.
        sample_size: Default image size in pixels (a multiple of twice the VAE factor).
        num_layers: Double-stream (MMDiT) blocks.
        num_single_layers: Single-stream blocks.
        vae_blocks: VAE encoder/decoder blocks; the VAE scale factor is ``2**(vae_blocks-1)``.
        clip_merges: BPE merges kept in the CLIP tokenizer.
        guidance_embeds: Whether the transformer takes the distilled guidance scale as an input (FLUX.1-dev: yes;
            FLUX.1-schnell: no).

    Returns:
        ``out_dir``.
    """
    diffusers: Any = importlib.import_module("diffusers")

    out_dir = Path(out_dir)
    clip_tok, vocab_size, t5_tok = sd3_tokenizers(clip_merges=clip_merges, clip_max_length=77, t5_max_length=512)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = diffusers.FluxTransformer2DModel(
            patch_size=1,
            in_channels=16,  # 4 latent channels x 2x2 packing
            num_layers=num_layers,
            num_single_layers=num_single_layers,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=32,  # T5 width
            pooled_projection_dim=32,  # CLIP pooled width
            guidance_embeds=guidance_embeds,
            axes_dims_rope=(2, 2, 4),  # sums to attention_head_dim, as FLUX.1's (16, 56, 56) sums to 128
        )
        te1, te2 = flux_text_encoders(vocab_size, len(t5_tok))
        vae = tiny_vae(sample_size, vae_blocks, shift_factor=0.1159, scaling_factor=0.3611)  # FLUX.1's VAE constants
    pipe = assemble_flux_pipeline(transformer, vae, (te1, te2), clip_tok, t5_tok, FLUX1_SCHEDULER_CONFIG)
    out_dir.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(str(out_dir))
    return out_dir


TINY_PREFIX = "tiny-random"


def cache_root() -> Path:
    """Where built assets are cached: ``$RLPOST_CACHE`` or ``~/.cache/rlpost``."""
    return Path(os.environ.get("RLPOST_CACHE", Path.home() / ".cache" / "rlpost")).expanduser()


def parse_tiny_id(name: str) -> int | None:
    """The seed of a ``tiny-random`` / ``tiny-random:SEED`` model id, or ``None`` for any other id.

    Raises:
        ValueError: For ``tiny-random:`` followed by something that is not an integer.
    """
    if name != TINY_PREFIX and not name.startswith(TINY_PREFIX + ":"):
        return None
    _, _, seed = name.partition(":")
    try:
        return int(seed) if seed else 0
    except ValueError:
        raise ValueError(f"model id {name!r}: expected 'tiny-random' or 'tiny-random:<integer seed>'") from None


def _ensure_built(name: str, build: Any, seed: int, root: Path | None) -> Path:
    target = (root or cache_root()) / f"{name}-seed{seed}"
    if (target / "model_index.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        build(Path(tmp) / "model", seed=seed)
        try:
            os.replace(Path(tmp) / "model", target)
        except OSError:
            if not (target / "model_index.json").is_file():  # another process finished first otherwise
                raise
    return target


def ensure_tiny_model(name: str, build: Callable[..., Path], seed: int = 0, root: Path | None = None) -> Path:
    """Build a tiny model into the cache once and return its directory, for model families outside rlpost (plugins).

    ``build(out_dir, seed=seed)`` writes a ``save_pretrained`` pipeline directory; it runs in a temporary directory
    next to the target, which is then renamed to ``<root>/<name>-seed<seed>`` (``root``: :func:`cache_root`), so an
    interrupted build leaves nothing behind and concurrent processes never see a half-written model. A directory
    that already holds ``model_index.json`` is returned as is.
    """
    return _ensure_built(name, build, seed, root)


def ensure_tiny_sd3(seed: int = 0, root: Path | None = None) -> Path:
    """Build the ``tiny-random:<seed>`` SD3 pipeline into the cache once (atomically: build, then rename) and return
    it.

    The result is an ordinary ``save_pretrained`` directory, loaded through ``StableDiffusion3Pipeline.from_pretrained``
    like any other model.
    """
    return _ensure_built("tiny-sd3", build_tiny_sd3, seed, root)


def ensure_tiny_flux(seed: int = 0, root: Path | None = None) -> Path:
    """Build the ``tiny-random:<seed>`` FLUX pipeline (:func:`build_tiny_flux`) into the cache once and return it.

    ``FluxPolicy(pretrained="tiny-random")`` loads it through ``FluxPipeline.from_pretrained``.
    """
    return _ensure_built("tiny-flux", build_tiny_flux, seed, root)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry: build a tiny SD3 or FLUX pipeline into a directory."""
    parser = argparse.ArgumentParser(description="Build a tiny random-weight SD3 or FLUX pipeline (real architecture).")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample-size", type=int, default=32)
    parser.add_argument("--num-layers", type=int, default=1)
    parser.add_argument("--family", choices=("sd3", "flux"), default="sd3", help="model family to build")
    args = parser.parse_args(argv)
    build = build_tiny_flux if args.family == "flux" else build_tiny_sd3
    path = build(args.out_dir, seed=args.seed, sample_size=args.sample_size, num_layers=args.num_layers)
    print(path)


if __name__ == "__main__":
    main()
