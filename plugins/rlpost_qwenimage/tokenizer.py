"""A Qwen2 byte-level BPE tokenizer built locally (no download) for the tiny Qwen-Image pipeline.

``QwenImagePipeline`` wraps every prompt in a chat template (``prompt_template_encode``: a system message asking to
describe the image, then the prompt as the user turn) and drops the first ``prompt_template_encode_start_idx = 34``
tokens of the text encoder's output, which is the template prefix as the released Qwen2 tokenizer splits it
(diffusers 0.42.1 ``pipelines/qwenimage/pipeline_qwenimage.py``, ``_get_qwen_prompt_embeds``). A tiny tokenizer must
therefore split that prefix into the same 34 tokens, or the pipeline would drop prompt tokens or keep template ones.

The vocabulary is learnt here with byte-pair encoding (Sennrich et al. 2016, arXiv 1508.07909) on a small text that
contains the template's words, so each of them is one token as in Qwen2; any other text still tokenizes through the
256 byte symbols. The merges are written as ``vocab.json`` / ``merges.txt`` and loaded by ``Qwen2Tokenizer``, whose
pre-tokenizer (Qwen2's split regex, then the byte-level map) is used to cut the training text, so training and use
split words identically. ``tests/plugins/qwenimage/test_tiny.py`` checks the 34-token prefix and that the
chat template renders the pipeline's prompt template.
"""

from __future__ import annotations

import importlib
import json
import tempfile
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "SYSTEM_PROMPT",
    "TRAINING_TEXT",
    "bpe_merges",
    "build_qwen2_tokenizer",
    "write_qwen2_tokenizer_files",
]

SYSTEM_PROMPT = (
    "Describe the image by detailing the color, shape, size, texture, quantity, text, spatial relationships of the "
    "objects and background:"
)
"""The system message of ``QwenImagePipeline.prompt_template_encode`` (diffusers 0.42.1)."""

TRAINING_TEXT = (
    f"system\nuser\nassistant\n{SYSTEM_PROMPT}\n"
    "a photo of a cat, a painting of a red dog, an apple and a flower on the table, two birds in a tree, three blue "
    "cars next to a green house, a black horse with a white bird, a small yellow boat, a large picture of the sea"
)
"""Text the tiny vocabulary is learnt from: the chat roles, the system message and common prompt words."""

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
"""Qwen2.5-VL's control tokens, in the order of their ids in the released vocabulary (pad ``<|endoftext|>``, the
ChatML turn markers, the vision markers the text encoder's config names)."""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML, the turn format of Qwen2 chat models and of ``prompt_template_encode``: with the system message and the
prompt as the user turn, plus the generation prompt, it renders exactly the pipeline's template."""


def _merge_pair(symbols: list[str], pair: tuple[str, str]) -> list[str]:
    """``symbols`` with every non-overlapping occurrence of ``pair``, left to right, joined into one symbol."""
    out: list[str] = []
    i = 0
    while i < len(symbols):
        if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
            out.append(symbols[i] + symbols[i + 1])
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return out


def bpe_merges(word_counts: Mapping[str, int]) -> list[tuple[str, str]]:
    """Byte-pair-encoding merges learnt on ``word_counts`` until every word is a single symbol.

    Each round joins the most frequent adjacent pair of symbols (counted over all words, weighted by the word's
    count); ties go to the lexicographically largest pair, so the result depends on the counts only.

    Args:
        word_counts: Pre-tokenized words (byte-level strings, e.g. ``"Ġthe"``) and how often each occurs.

    Returns:
        The merges in the order learnt (their rank).
    """
    words = {w: list(w) for w in word_counts}
    merges: list[tuple[str, str]] = []
    while True:
        pairs: Counter[tuple[str, str]] = Counter()
        for w, symbols in words.items():
            for pair in zip(symbols, symbols[1:], strict=False):
                pairs[pair] += word_counts[w]
        if not pairs:
            return merges
        best = max(pairs, key=lambda p: (pairs[p], p))
        merges.append(best)
        words = {w: _merge_pair(symbols, best) for w, symbols in words.items()}


def write_qwen2_tokenizer_files(out_dir: Path, text: str = TRAINING_TEXT) -> int:
    """Write ``vocab.json`` and ``merges.txt`` of a byte-level BPE learnt on ``text``.

    Vocabulary order: the 256 byte-level symbols (by code point), one token per merge, then :data:`SPECIAL_TOKENS`.

    Returns:
        The vocabulary size.
    """
    transformers: Any = importlib.import_module("transformers")
    tokenizers: Any = importlib.import_module("tokenizers")
    # An empty Qwen2Tokenizer carries Qwen2's pre-tokenizer: cut the training text exactly as tokenizing will.
    pre = transformers.Qwen2Tokenizer().backend_tokenizer.pre_tokenizer
    counts = Counter(piece for piece, _ in pre.pre_tokenize_str(text))
    merges = bpe_merges(counts)
    vocab = {symbol: i for i, symbol in enumerate(sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet()))}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    lines = "".join(f"{a} {b}\n" for a, b in merges)
    (out_dir / "merges.txt").write_text("#version: 0.2\n" + lines, encoding="utf-8")
    return len(vocab)


def build_qwen2_tokenizer(text: str = TRAINING_TEXT, model_max_length: int = 32768) -> Any:
    """A real ``Qwen2Tokenizer`` over a vocabulary learnt on ``text`` (:func:`write_qwen2_tokenizer_files`).

    Special tokens as Qwen2.5-VL's: pad ``<|endoftext|>``, eos ``<|im_end|>``, the ChatML and vision markers; right
    padding; :data:`CHAT_TEMPLATE`.

    Args:
        text: Training text of the vocabulary.
        model_max_length: The tokenizer's ``model_max_length`` (Qwen2's 32768).
    """
    transformers: Any = importlib.import_module("transformers")
    with tempfile.TemporaryDirectory() as tmp:
        write_qwen2_tokenizer_files(Path(tmp), text)
        tok = transformers.Qwen2Tokenizer(
            vocab=str(Path(tmp) / "vocab.json"),
            merges=str(Path(tmp) / "merges.txt"),
            unk_token=None,
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            additional_special_tokens=list(SPECIAL_TOKENS[1:]),
            model_max_length=model_max_length,
        )
    tok.padding_side = "right"
    tok.chat_template = CHAT_TEMPLATE
    return tok
