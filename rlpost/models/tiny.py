"""Tiny, randomly initialised SD3 and FLUX.1 pipelines with the *real* diffusers/transformers architecture.

Tests, examples and CPU benchmarks need an SD3 model without downloading weights. :func:`build_tiny_sd3` builds a
``StableDiffusion3Pipeline`` from small configs (VAE scale factor 2, patch 2, ``pos_embed_max_size`` small, so the
positional-embedding buffer does not dominate the file), with tokenizers made locally:

* CLIP: a real byte-level BPE from open_clip's bundled ``bpe_simple_vocab_16e6.txt.gz`` (first ``clip_merges`` merges).
* T5: a Unigram tokenizer built from a vocabulary defined here (transformers 5's ``T5Tokenizer(vocab=...)``).

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
import gzip
import importlib
import importlib.resources
import json
import os
import string
import tempfile
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "assemble_sd3_pipeline",
    "build_clip_tokenizer",
    "build_text_encoders",
    "build_tiny_flux",
    "build_tiny_sd3",
    "ensure_tiny_flux",
    "ensure_tiny_model",
    "main",
    "sd3_tokenizers",
    "t5_vocab",
    "write_clip_tokenizer_files",
]


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP byte -> printable unicode map (printable bytes map to themselves, the rest above 255)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    byte_vals = printable[:]
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in byte_vals:
            byte_vals.append(b)
            codes.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(byte_vals, codes, strict=True)}


def write_clip_tokenizer_files(out_dir: Path, num_merges: int | None = 1000) -> int:
    """Write ``vocab.json`` and ``merges.txt`` of a CLIP BPE tokenizer from open_clip's bundled merges.

    Vocabulary order (as in openai/clip-vit-large-patch14): 256 byte symbols, the same with ``</w>``, one token per
    merge, then ``<|startoftext|>`` and ``<|endoftext|>``.

    Args:
        out_dir: Directory to write into (created).
        num_merges: Keep only the first merges (1000 gives a 1514-token vocabulary); ``None`` keeps all 48894.

    Returns:
        The vocabulary size.
    """
    bpe = importlib.resources.files("open_clip") / "bpe_simple_vocab_16e6.txt.gz"
    lines = gzip.decompress(bpe.read_bytes()).decode("utf-8").split("\n")
    merges = lines[1 : 49152 - 256 - 2 + 1]  # the first line is a version header
    if num_merges is not None:
        merges = merges[:num_merges]
    pairs = [tuple(m.split()) for m in merges]
    byte_syms = list(_bytes_to_unicode().values())
    vocab = byte_syms + [s + "</w>" for s in byte_syms] + ["".join(p) for p in pairs]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(vocab)}), encoding="utf-8")
    merges_txt = "#version: 0.2\n" + "\n".join(" ".join(p) for p in pairs) + "\n"
    (out_dir / "merges.txt").write_text(merges_txt, encoding="utf-8")
    return len(vocab)


def t5_vocab(extra_words: Sequence[str] = ()) -> list[tuple[str, float]]:
    """A small SentencePiece-style Unigram vocabulary: specials, characters and common English pieces, plus
    ``extra_words`` (whole words scored just below the common ones, so prompts using them stay short)."""
    words = (
        "a an the of and in on with to at for is are photo picture image painting drawing digit number zero one "
        "two three four five six seven eight nine cat dog bird car house tree sky red green blue black white "
        "small large big cute happy old new city street river mountain sea beach forest flower person man woman"
    ).split()
    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + w, -5.0 - 0.01 * i) for i, w in enumerate(words)]
    chars = string.ascii_lowercase + string.ascii_uppercase + string.digits + ".,!?'-"
    pieces += [(c, -10.0) for c in chars] + [("▁" + c, -9.0) for c in chars]
    have = {p for p, _ in pieces}
    return pieces + [("▁" + w, -6.0 - 0.01 * i) for i, w in enumerate(extra_words) if "▁" + w not in have]


def sd3_tokenizers(
    t5_pieces: list[tuple[str, float]] | None = None,
    *,
    clip_merges: int | None = 1000,
    clip_max_length: int = 77,
    t5_max_length: int = 256,
) -> tuple[Any, int, Any]:
    """The SD3 tokenizers made locally: (CLIP BPE tokenizer, its vocabulary size, T5 Unigram tokenizer).

    Args:
        t5_pieces: The T5 vocabulary (default :func:`t5_vocab`).
        clip_merges: BPE merges kept in the CLIP tokenizer (``None``: all).
        clip_max_length: CLIP ``model_max_length`` (the pipeline pads and truncates CLIP prompts to it).
        t5_max_length: T5 ``model_max_length``.
    """
    transformers: Any = importlib.import_module("transformers")
    clip_tok, vocab_size = build_clip_tokenizer(clip_merges, max_length=clip_max_length)
    pieces = t5_vocab() if t5_pieces is None else t5_pieces
    t5_tok = transformers.T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=t5_max_length)
    return clip_tok, vocab_size, t5_tok


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


def build_clip_tokenizer(num_merges: int | None, max_length: int) -> tuple[Any, int]:
    """A real CLIP BPE tokenizer from open_clip's bundled vocabulary (no download), and its vocabulary size.

    Args:
        num_merges: BPE merges kept (``None``: all, the full 49408-token vocabulary).
        max_length: ``model_max_length`` (the SD3 pipeline pads and truncates CLIP prompts to it).
    """
    transformers: Any = importlib.import_module("transformers")
    with tempfile.TemporaryDirectory() as tmp:
        vocab_size = write_clip_tokenizer_files(Path(tmp), num_merges)
        tok = transformers.CLIPTokenizer(
            vocab=str(Path(tmp) / "vocab.json"), merges=str(Path(tmp) / "merges.txt"), model_max_length=max_length
        )
    return tok, vocab_size


def build_text_encoders(
    clip_vocab: int,
    t5_vocab: int,
    *,
    clip_hidden: int = 32,
    clip_intermediate: int = 37,
    clip_max_positions: int = 77,
    t5_d_model: int = 32,
    t5_d_kv: int = 8,
    t5_d_ff: int = 37,
    clip_overrides: Sequence[Mapping[str, Any]] | None = None,
    t5_overrides: Mapping[str, Any] | None = None,
) -> tuple[Any, Any, Any]:
    """The SD3 text-encoder stack at tiny size: two ``CLIPTextModelWithProjection`` (2 layers, projection 32) and a
    one-layer ``T5EncoderModel``, drawn from the global torch RNG in that order (callers seed it).

    Args:
        clip_vocab: CLIP vocabulary size (the last two ids are BOS and EOS/pad, see `write_clip_tokenizer_files`).
        t5_vocab: T5 vocabulary size (pad id 0, EOS id 1).
        clip_hidden: CLIP hidden size.
        clip_intermediate: CLIP MLP size.
        clip_max_positions: CLIP context length.
        t5_d_model: T5 model width.
        t5_d_kv: T5 per-head width.
        t5_d_ff: T5 MLP size.
        clip_overrides: Per CLIP encoder, ``CLIPTextConfig`` fields replacing the tiny ones (e.g. SD3.5's widths).
        t5_overrides: ``T5Config`` fields replacing the tiny ones.
    """
    transformers: Any = importlib.import_module("transformers")
    clip_base: dict[str, Any] = dict(
        bos_token_id=clip_vocab - 2,
        eos_token_id=clip_vocab - 1,
        pad_token_id=clip_vocab - 1,
        hidden_size=clip_hidden,
        intermediate_size=clip_intermediate,
        num_attention_heads=4,
        num_hidden_layers=2,
        vocab_size=clip_vocab,
        hidden_act="gelu",
        projection_dim=32,
        max_position_embeddings=clip_max_positions,
    )
    clip_extra = clip_overrides if clip_overrides is not None else ({}, {})
    te1, te2 = [
        transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(**{**clip_base, **extra}))
        for extra in clip_extra
    ]
    t5_base: dict[str, Any] = dict(
        vocab_size=t5_vocab,
        d_model=t5_d_model,
        d_kv=t5_d_kv,
        d_ff=t5_d_ff,
        num_layers=1,
        num_heads=4,
        relative_attention_num_buckets=8,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    t5_cfg = transformers.T5Config(**{**t5_base, **(t5_overrides or {})})
    return te1, te2, transformers.T5EncoderModel(t5_cfg)


def flux_text_encoders(clip_vocab: int, t5_vocab: int, **sizes: Any) -> tuple[Any, Any]:
    """FLUX's text encoders: a ``CLIPTextModel`` (pooled output, no projection) and a ``T5EncoderModel``, from
    :func:`build_text_encoders` (``sizes`` are its keyword arguments), drawn from the global torch RNG."""
    transformers: Any = importlib.import_module("transformers")
    te1, _, te2 = build_text_encoders(clip_vocab, t5_vocab, **sizes)
    # Rebuilt from the first CLIP's config (a fresh draw, after the three above, so seeded builds are unchanged).
    return transformers.CLIPTextModel(te1.config), te2


def build_tiny_sd3(
    out_dir: Path,
    *,
    seed: int = 0,
    sample_size: int = 32,
    num_layers: int = 1,
    patch_size: int = 2,
    vae_blocks: int = 2,
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
    sample_size: int = 32,
    num_layers: int = 1,
    num_single_layers: int = 1,
    vae_blocks: int = 2,
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
