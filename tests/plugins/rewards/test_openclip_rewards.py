"""HPS-v2.1 and CLIPScore through the production loaders, on a tiny open_clip model with random weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import rlpost_rewards.clipscore as clipscore_mod
import rlpost_rewards.hps as hps_mod
from rlpost_rewards._paths import CheckpointNotFoundError

from .conftest import PROMPTS, LoadCounter, check_reward_contract, make_images


def _reference_cosine(tiny_clip_name: str, state: dict[str, torch.Tensor], images: torch.Tensor) -> torch.Tensor:
    """Independent computation: open_clip's own PIL eval transform and ``output_dict`` forward (HPSv2 img_score.py)."""
    import open_clip
    from PIL import Image

    model, _, preprocess = open_clip.create_model_and_transforms(tiny_clip_name, pretrained=None, output_dict=True)
    model.load_state_dict(state)
    model.eval()
    tokenizer = open_clip.get_tokenizer(tiny_clip_name)
    pixels = torch.stack([preprocess(Image.fromarray(a)) for a in images.numpy()])
    with torch.no_grad():
        out = model(pixels, tokenizer(PROMPTS[: len(images)]))
    return torch.diagonal(out["image_features"] @ out["text_features"].T)


def test_hps_scores_via_checkpoint(tmp_path: Path, tiny_clip_name, tiny_clip_state, monkeypatch) -> None:
    ckpt = tmp_path / "HPS_v2.1_compressed.pt"
    torch.save({"state_dict": {f"module.{k}": v for k, v in tiny_clip_state.items()}}, ckpt)  # DDP-style prefix
    counter = LoadCounter(hps_mod.load_hps_state_dict)
    monkeypatch.setattr(hps_mod, "load_hps_state_dict", counter)
    monkeypatch.setenv("RLPOST_MODELS", str(tmp_path))  # default file name under $RLPOST_MODELS
    reward = hps_mod.HPSv2Reward(model_name=tiny_clip_name)
    reward.setup(torch.device("cpu"))
    reward.setup(torch.device("cpu"))
    images = make_images(8, size=40)
    scores = check_reward_contract(reward, images, PROMPTS)
    for _ in range(3):
        reward.score(images[:2], PROMPTS[:2], [{}, {}])
    assert counter.calls == 1
    assert scores.abs().max() <= 1.0 + 1e-6  # a cosine
    # Tensor preprocessing approximates the PIL pipeline (bicubic resize of uint8 differs by rounding only).
    torch.testing.assert_close(scores, _reference_cosine(tiny_clip_name, tiny_clip_state, images), atol=5e-3, rtol=0)


def test_hps_exact_match_when_no_resize(tmp_path: Path, tiny_clip_name, tiny_clip_state) -> None:
    ckpt = tmp_path / "hps.pt"
    torch.save({"state_dict": tiny_clip_state}, ckpt)
    reward = hps_mod.HPSv2Reward(checkpoint=str(ckpt), model_name=tiny_clip_name)
    reward.setup(torch.device("cpu"))
    images = make_images(4, size=32)  # model input size: no resampling, so equal to the PIL path
    ref = _reference_cosine(tiny_clip_name, tiny_clip_state, images)
    torch.testing.assert_close(reward.score(images, PROMPTS[:4], [{}] * 4), ref, atol=1e-5, rtol=0)


def test_hps_rejects_mismatched_checkpoint(tmp_path: Path, tiny_clip_name, tiny_clip_state) -> None:
    ckpt = tmp_path / "hps.pt"
    torch.save({"state_dict": {k: v for k, v in tiny_clip_state.items() if "visual" not in k}}, ckpt)
    with pytest.raises(ValueError, match="missing"):
        hps_mod.HPSv2Reward(checkpoint=str(ckpt), model_name=tiny_clip_name).setup(torch.device("cpu"))


def test_hps_refuses_pickled_code(tmp_path: Path, tiny_clip_name) -> None:
    ckpt = tmp_path / "evil.pt"
    torch.save({"state_dict": {}, "obj": Path("x")}, ckpt)  # an arbitrary class needs full unpickling
    with pytest.raises(Exception, match="[Ww]eights only|weights_only"):
        hps_mod.HPSv2Reward(checkpoint=str(ckpt), model_name=tiny_clip_name).setup(torch.device("cpu"))


def test_missing_checkpoints_name_file_and_location(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("RLPOST_MODELS", str(tmp_path))
    with pytest.raises(CheckpointNotFoundError) as err:
        hps_mod.HPSv2Reward().setup(torch.device("cpu"))
    message = str(err.value)
    assert "HPS_v2.1_compressed.pt" in message and str(tmp_path) in message and "huggingface.co/xswu/HPSv2" in message
    monkeypatch.delenv("RLPOST_MODELS")
    with pytest.raises(CheckpointNotFoundError, match="RLPOST_MODELS is not set"):
        clipscore_mod.CLIPScoreReward().setup(torch.device("cpu"))
    with pytest.raises(CheckpointNotFoundError, match=r"nope\.bin \(constructor argument\)"):
        clipscore_mod.CLIPScoreReward(pretrained=str(tmp_path / "nope.bin")).setup(torch.device("cpu"))


def test_clipscore_conventions(tmp_path: Path, tiny_clip_name, tiny_clip_state, monkeypatch) -> None:
    weights = tmp_path / "open_clip_model.safetensors"
    save_file({k: v.contiguous() for k, v in tiny_clip_state.items()}, str(weights))
    counter = LoadCounter(clipscore_mod.OpenClipScorer.build)
    monkeypatch.setattr(clipscore_mod.OpenClipScorer, "build", counter)
    raw = clipscore_mod.CLIPScoreReward(pretrained=str(weights), model_name=tiny_clip_name)
    raw.setup(torch.device("cpu"))
    raw.setup(torch.device("cpu"))
    images = make_images(8, size=40)
    cos = check_reward_contract(raw, images, PROMPTS)
    assert counter.calls == 1
    scaled = clipscore_mod.CLIPScoreReward(pretrained=str(weights), model_name=tiny_clip_name, scale_100=True)
    scaled.setup(torch.device("cpu"))
    torch.testing.assert_close(scaled.score(images, PROMPTS, [{}] * 8), 100 * cos.clamp_min(0), atol=1e-4, rtol=0)
    # the same weights as a torch .pt file (open_clip loads it with weights_only=True)
    pt = tmp_path / "w.pt"
    torch.save(tiny_clip_state, pt)
    again = clipscore_mod.CLIPScoreReward(pretrained=str(pt), model_name=tiny_clip_name)
    again.setup(torch.device("cpu"))
    torch.testing.assert_close(again.score(images, PROMPTS, [{}] * 8), cos)


def test_score_before_setup_and_bad_inputs(tiny_clip_name) -> None:
    reward = clipscore_mod.CLIPScoreReward(model_name=tiny_clip_name)
    with pytest.raises(RuntimeError, match="setup"):
        reward.score(make_images(1), ["x"], [{}])
    with pytest.raises(ValueError, match="prompts"):
        reward.score(make_images(2), ["x"], [{}])
