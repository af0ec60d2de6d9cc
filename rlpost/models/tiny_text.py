"""The text side of the tiny real-architecture models (:mod:`rlpost.models.tiny`): tokenizers made locally, without a
download, and the SD3 and FLUX.1 text-encoder stacks at tiny size.

* CLIP: a real byte-level BPE from open_clip's bundled ``bpe_simple_vocab_16e6.txt.gz`` (first ``clip_merges`` merges).
* T5: a Unigram tokenizer built from a vocabulary defined here (transformers 5's ``T5Tokenizer(vocab=...)``).

Encoders are drawn from the global torch RNG (callers seed it), so a seeded build is reproducible.
"""

from __future__ import annotations

import gzip
import importlib
import importlib.resources
import json
import string
import tempfile
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = [
    "build_clip_tokenizer",
    "build_text_encoders",
    "flux_text_encoders",
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
