"""The tiny Qwen-Image build: a locally learnt Qwen2 tokenizer that splits the pipeline's prompt template as the
released one does, real classes at tiny size, deterministic, small, loadable through from_pretrained."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import QwenImagePipeline
from safetensors.torch import load_file

from rlpost_qwenimage.tiny import QWEN_IMAGE_SCHEDULER_CONFIG, TINY_LATENTS_STD, TINY_VAE_FACTOR, main
from rlpost_qwenimage.tokenizer import (
    SPECIAL_TOKENS,
    SYSTEM_PROMPT,
    TRAINING_TEXT,
    bpe_merges,
    write_qwen2_tokenizer_files,
)


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_bpe_merges_are_deterministic() -> None:
    merges = bpe_merges({"Ġthe": 3, "Ġthen": 1, "the": 2})
    assert merges[0] == ("t", "h")  # 6 occurrences, tied with (h, e): the lexicographically larger pair wins
    assert merges == bpe_merges({"the": 2, "Ġthen": 1, "Ġthe": 3})  # the counts decide, not the insertion order
    assert {"Ġthe", "Ġthen", "the"} <= {a + b for a, b in merges}  # learnt until every word is one symbol


def test_every_training_word_is_one_token(tmp_path: Path) -> None:
    from transformers import Qwen2Tokenizer

    size = write_qwen2_tokenizer_files(tmp_path)
    merges = (tmp_path / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert merges[0] == "#version: 0.2" and size == 256 + len({m.replace(" ", "") for m in merges[1:]}) + 7
    tok = Qwen2Tokenizer(vocab=str(tmp_path / "vocab.json"), merges=str(tmp_path / "merges.txt"))
    words = [TRAINING_TEXT[a:b] for _, (a, b) in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(TRAINING_TEXT)]
    assert len(words) > 60
    assert all(len(tok(w, add_special_tokens=False)["input_ids"]) == 1 for w in words), words


def test_tokenizer_splits_the_prompt_template_as_qwen2(tiny_qwenimage_dir: Path) -> None:
    """The pipeline drops the first prompt_template_encode_start_idx (34) tokens of the templated prompt: the tiny
    tokenizer must split the template's prefix into exactly that many, every word of it one token as in Qwen2."""
    pipe = QwenImagePipeline.from_pretrained(str(tiny_qwenimage_dir), local_files_only=True)
    tok = pipe.tokenizer
    template, drop = pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx
    assert drop == 34
    prefix = tok(template.format(""))["input_ids"][:drop]
    prompt = tok(template.format("a photo of a cat"))["input_ids"]
    assert prompt[:drop] == prefix and tok.decode(prompt[drop:]).startswith("a photo of a cat<|im_end|>")
    pieces = tok.convert_ids_to_tokens(prefix)
    assert pieces[:4] == ["<|im_start|>", "system", "Ċ", "Describe"] and pieces[-3:] == ["<|im_start|>", "user", "Ċ"]
    assert "Ġrelationships" in pieces and "Ġbackground" in pieces
    # The chat template renders the pipeline's prompt template (system message, user turn, generation prompt).
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "a red dog"}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == template.format("a red dog")
    # Any other text still round-trips through the byte symbols; control tokens are single special tokens.
    text = "Zebra #7 naïve 猫!"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert [len(tok(t, add_special_tokens=False)["input_ids"]) for t in SPECIAL_TOKENS] == [1] * len(SPECIAL_TOKENS)
    assert tok.pad_token == "<|endoftext|>" and tok.padding_side == "right"
    assert pipe.text_encoder.config.text_config.pad_token_id == tok.pad_token_id
    assert pipe.text_encoder.config.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")


def test_tiny_pipeline_loads_and_is_small(tiny_qwenimage_dir: Path) -> None:
    assert _dir_size(tiny_qwenimage_dir) < 1_500_000
    pipe = QwenImagePipeline.from_pretrained(str(tiny_qwenimage_dir), local_files_only=True)
    assert type(pipe.text_encoder).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert type(pipe.vae).__name__ == "AutoencoderKLQwenImage" and pipe.vae_scale_factor == TINY_VAE_FACTOR == 2
    assert pipe.transformer.config.in_channels == 4 * pipe.vae.config.z_dim
    assert pipe.transformer.config.joint_attention_dim == pipe.text_encoder.config.text_config.hidden_size
    assert tuple(pipe.vae.config.latents_std) == TINY_LATENTS_STD
    assert {k: pipe.scheduler.config[k] for k in QWEN_IMAGE_SCHEDULER_CONFIG} == dict(QWEN_IMAGE_SCHEDULER_CONFIG)
    for m in (pipe.transformer, pipe.vae, pipe.text_encoder):
        assert not m.training


def test_tiny_builder_is_deterministic_and_has_a_cli(tiny_qwenimage_dir: Path, tmp_path: Path) -> None:
    main([str(tmp_path / "again")])
    main([str(tmp_path / "other"), "--seed", "1"])
    for name in ("transformer/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors"):
        a, b, c = (load_file(str(d / name)) for d in (tiny_qwenimage_dir, tmp_path / "again", tmp_path / "other"))
        assert a.keys() == b.keys() == c.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert not all(torch.equal(a[k], c[k]) for k in a)
    vocab = (tiny_qwenimage_dir / "tokenizer" / "tokenizer.json").read_text(encoding="utf-8")
    assert vocab == (tmp_path / "again" / "tokenizer" / "tokenizer.json").read_text(encoding="utf-8")
