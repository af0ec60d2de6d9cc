"""LAION aesthetic and PickScore through the production loaders, on tiny transformers CLIP models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import rlpost_rewards._hfclip as hfclip_mod
import rlpost_rewards.aesthetic as aesthetic_mod
from rlpost_rewards._paths import CheckpointNotFoundError
from rlpost_rewards.pickscore import PickScoreReward

from .conftest import PROMPTS, LoadCounter, check_reward_contract, make_images, tiny_hf_clip, write_clip_tokenizer


@pytest.fixture(scope="module")
def clip_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int]:
    root = tmp_path_factory.mktemp("hfclip")
    tok_dir = root / "tokenizer"
    vocab = write_clip_tokenizer(tok_dir)
    (tok_dir / "preprocessor_config.json").write_text(
        json.dumps({"crop_size": {"height": 32, "width": 32}, "image_mean": [0.5] * 3, "image_std": [0.25] * 3})
    )
    model_dir = root / "model"
    tiny_hf_clip(vocab).save_pretrained(str(model_dir))  # safetensors, as the hub snapshots
    return model_dir, tok_dir, vocab


def test_aesthetic(tmp_path: Path, clip_dirs, monkeypatch) -> None:
    model_dir, _, _ = clip_dirs
    torch.manual_seed(1)
    head = aesthetic_mod.AestheticMLP(16).eval()
    head_path = tmp_path / "sac+logos+ava1-l14-linearMSE.pth"
    torch.save(head.state_dict(), head_path)
    counter = LoadCounter(aesthetic_mod.load_aesthetic_head)
    monkeypatch.setattr(aesthetic_mod, "load_aesthetic_head", counter)
    reward = aesthetic_mod.AestheticReward(clip_dir=str(model_dir), head=str(head_path))
    reward.setup(torch.device("cpu"))
    reward.setup(torch.device("cpu"))
    images = make_images(8, size=48)
    scores = check_reward_contract(reward, images, PROMPTS)
    assert counter.calls == 1
    # independent computation: CLIPModel projected embedding, L2-normalised, through the head (ddpo-pytorch)
    from rlpost_rewards._common import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, clip_preprocess

    clip = tiny_hf_clip(int(json.loads((model_dir / "config.json").read_text())["text_config"]["vocab_size"]))
    with torch.no_grad():
        out = clip.vision_model(pixel_values=clip_preprocess(images, 32, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD))
        emb = clip.visual_projection(out.pooler_output)
        expected = head(emb / emb.norm(dim=-1, keepdim=True)).squeeze(1)
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=0)


def test_aesthetic_head_formats_and_errors(tmp_path: Path, clip_dirs, monkeypatch) -> None:
    from safetensors.torch import save_file

    model_dir, _, _ = clip_dirs
    head = aesthetic_mod.AestheticMLP(16)
    save_file(head.state_dict(), str(tmp_path / "head.safetensors"))
    loaded = aesthetic_mod.load_aesthetic_head(tmp_path / "head.safetensors")
    assert torch.equal(loaded.layers[7].weight, head.layers[7].weight)
    wrong = tmp_path / "wrong.pth"
    torch.save(aesthetic_mod.AestheticMLP(24).state_dict(), wrong)
    with pytest.raises(ValueError, match="24-d"):
        aesthetic_mod.AestheticReward(clip_dir=str(model_dir), head=str(wrong)).setup(torch.device("cpu"))
    monkeypatch.setenv("RLPOST_MODELS", str(tmp_path))
    with pytest.raises(CheckpointNotFoundError, match="clip-vit-large-patch14.*directory|directory.*clip-vit-large"):
        aesthetic_mod.AestheticReward().setup(torch.device("cpu"))


def test_pickscore(clip_dirs, monkeypatch) -> None:
    model_dir, tok_dir, _ = clip_dirs
    counter = LoadCounter(hfclip_mod.HFClip.load)
    monkeypatch.setattr(hfclip_mod.HFClip, "load", counter)
    reward = PickScoreReward(model_dir=str(model_dir), tokenizer_dir=str(tok_dir))
    reward.setup(torch.device("cpu"))
    reward.setup(torch.device("cpu"))
    images = make_images(8, size=48)
    logits = check_reward_contract(reward, images, PROMPTS, tol=2e-4)  # logit_scale (~14) amplifies fp noise
    assert counter.calls == 1
    assert reward._clip is not None and reward._clip.size == 32 and reward._clip.mean == (0.5, 0.5, 0.5)
    cosine = PickScoreReward(model_dir=str(model_dir), tokenizer_dir=str(tok_dir), convention="cosine")
    cosine.setup(torch.device("cpu"))
    cos = cosine.score(images, PROMPTS, [{}] * 8)
    scale = reward._logit_scale
    assert scale == pytest.approx(1 / 0.07, rel=1e-4)  # CLIP's initial logit scale
    torch.testing.assert_close(logits, scale * cos, atol=1e-4, rtol=0)
    flow = PickScoreReward(model_dir=str(model_dir), tokenizer_dir=str(tok_dir), convention="flow-grpo")
    flow.setup(torch.device("cpu"))
    torch.testing.assert_close(flow.score(images, PROMPTS, [{}] * 8), logits / 26, atol=1e-5, rtol=0)


def test_pickscore_rejects_tokenizer_with_wrong_vocab(tmp_path: Path, clip_dirs) -> None:
    model_dir, _, _ = clip_dirs
    small = tmp_path / "small_tok"
    write_clip_tokenizer(small, num_merges=10)
    with pytest.raises(ValueError, match="tokens but the text tower expects"):
        PickScoreReward(model_dir=str(model_dir), tokenizer_dir=str(small)).setup(torch.device("cpu"))
