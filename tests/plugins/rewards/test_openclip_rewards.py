"""HPS-v2.1 and CLIPScore through the production loaders, on a tiny open_clip model with random weights, against
restatements of the upstream scorers that share no code with ``rlpost_rewards``:

* HPS: ``tgxs002/HPSv2 hpsv2/img_score.py@866735e`` (and MixGRPO's ``hps_score.py``, which copies it): the eval
  transform of ``create_model_and_transforms(..., light_augmentation=True)`` (``ToTensor`` -> ``ResizeMaxSize``:
  longest side to the model size, bicubic on floats, zero padding -> ``Normalize`` with OpenAI CLIP's statistics),
  then ``diagonal(image_features @ text_features.T)`` of the model's normalised ``output_dict`` features.
* CLIPScore: ``Tencent-Hunyuan/MixGRPO fastvideo/models/reward_model/clip_score.py@e5cdd6a``: the transform
  ``open_clip.create_model_from_pretrained`` returns, on PIL images, then the cosine of ``encode_image`` and
  ``encode_text``.

Inputs at the model size need no resize, so both paths see the same pixels: agreement to 1e-5 (cosines) catches a
wrong mean/std or a missing normalisation. Resized and non-square inputs agree within the measured rounding.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from safetensors.torch import save_file

import rlpost_rewards.clipscore as clipscore_mod
import rlpost_rewards.hps as hps_mod
from rlpost_rewards._paths import CheckpointNotFoundError

from .conftest import PROMPTS, LoadCounter, check_reward_contract, make_images

OPENAI_MEAN, OPENAI_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def hps_pixels(images: torch.Tensor, size: int) -> torch.Tensor:
    """HPSv2 ``image_transform(size, is_train=False, resize_longest_max=True)`` on PIL images."""
    from PIL import Image
    from torchvision.transforms import InterpolationMode, Normalize, ToTensor
    from torchvision.transforms import functional as TVF  # noqa: N812

    out = []
    for array in images.numpy():
        img = ToTensor()(Image.fromarray(array).convert("RGB"))
        height, width = img.shape[1:]
        scale = size / float(max(height, width))
        if scale != 1.0:  # ResizeMaxSize.forward
            new = [round(height * scale), round(width * scale)]
            img = TVF.resize(img, new, InterpolationMode.BICUBIC)
            ph, pw = size - new[0], size - new[1]
            img = TVF.pad(img, [pw // 2, ph // 2, pw - pw // 2, ph - ph // 2], fill=0)
        out.append(Normalize(OPENAI_MEAN, OPENAI_STD)(img))
    return torch.stack(out)


def hps_reference(tiny_clip_name: str, state: dict[str, torch.Tensor], images: torch.Tensor) -> torch.Tensor:
    """HPSv2 ``score``: ``model(image, text)`` with ``output_dict=True``, diagonal of ``img @ txt.T``."""
    import open_clip

    model = open_clip.create_model(tiny_clip_name, pretrained=None, output_dict=True)
    model.load_state_dict(state)
    model.eval()
    tokenizer = open_clip.get_tokenizer(tiny_clip_name)
    with torch.no_grad():
        out = model(hps_pixels(images, model.visual.image_size[0]), tokenizer(PROMPTS[: len(images)]))
    return torch.diagonal(out["image_features"] @ out["text_features"].T)


def clipscore_reference(tiny_clip_name: str, weights: Path, images: torch.Tensor) -> torch.Tensor:
    """MixGRPO ``CLIPScoreRewardModel.__call__``: open_clip's own transform, encode, ``F.normalize``, dot."""
    import open_clip
    from PIL import Image

    model, preprocess = open_clip.create_model_from_pretrained(tiny_clip_name, pretrained=str(weights))
    model.eval()
    tokenizer = open_clip.get_tokenizer(tiny_clip_name)
    scores = []
    with torch.no_grad():
        for array, prompt in zip(images.numpy(), PROMPTS, strict=False):
            image = preprocess(Image.fromarray(array).convert("RGB")).unsqueeze(0)
            text = tokenizer([prompt], context_length=model.context_length)
            img, txt = F.normalize(model.encode_image(image), dim=-1), F.normalize(model.encode_text(text), dim=-1)
            scores.append((img @ txt.T).item())
    return torch.tensor(scores)


def test_hps_scores_via_checkpoint(tmp_path: Path, tiny_clip_name, tiny_clip_state, monkeypatch) -> None:
    ckpt = tmp_path / "HPS_v2.1_compressed.pt"
    torch.save({"state_dict": {f"module.{k}": v for k, v in tiny_clip_state.items()}}, ckpt)  # DDP-style prefix
    counter = LoadCounter(hps_mod.load_hps_state_dict)
    monkeypatch.setattr(hps_mod, "load_hps_state_dict", counter)
    monkeypatch.setenv("RLPOST_MODELS", str(tmp_path))  # default file name under $RLPOST_MODELS
    reward = hps_mod.HPSv2Reward(model_name=tiny_clip_name)
    reward.setup(torch.device("cpu"))
    reward.setup(torch.device("cpu"))
    images = make_images(8, size=32)  # the model size: no resize, both paths see the same pixels
    scores = check_reward_contract(reward, images, PROMPTS)
    for _ in range(3):
        reward.score(images[:2], PROMPTS[:2], [{}, {}])
    assert counter.calls == 1
    assert scores.abs().max() <= 1.0 + 1e-6  # a cosine
    expected = hps_reference(tiny_clip_name, tiny_clip_state, images)
    assert expected.std() > 0.01
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("height", "width"), [(40, 40), (40, 56), (56, 24)])
def test_hps_resizes_and_letterboxes_like_hpsv2(tmp_path: Path, tiny_clip_name, tiny_clip_state, height, width) -> None:
    """Resized (float bicubic on both sides) and non-square inputs: HPSv2 pads to a square, it does not crop."""
    ckpt = tmp_path / "hps.pt"
    torch.save({"state_dict": tiny_clip_state}, ckpt)
    reward = hps_mod.HPSv2Reward(checkpoint=str(ckpt), model_name=tiny_clip_name)
    reward.setup(torch.device("cpu"))
    images = make_images(8, size=max(height, width))[:, :height, :width].contiguous()
    expected = hps_reference(tiny_clip_name, tiny_clip_state, images)
    torch.testing.assert_close(reward.score(images, PROMPTS, [{}] * 8), expected, atol=1e-5, rtol=0)


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


def test_clipscore_matches_mixgrpo_scorer(tmp_path: Path, tiny_clip_name, tiny_clip_state, monkeypatch) -> None:
    weights = tmp_path / "open_clip_model.safetensors"
    save_file({k: v.contiguous() for k, v in tiny_clip_state.items()}, str(weights))
    counter = LoadCounter(clipscore_mod.OpenClipScorer.build)
    monkeypatch.setattr(clipscore_mod.OpenClipScorer, "build", counter)
    raw = clipscore_mod.CLIPScoreReward(pretrained=str(weights), model_name=tiny_clip_name)
    raw.setup(torch.device("cpu"))
    raw.setup(torch.device("cpu"))
    assert counter.calls == 1
    images = make_images(8, size=32)
    cos = check_reward_contract(raw, images, PROMPTS)
    expected = clipscore_reference(tiny_clip_name, weights, images)
    assert expected.std() > 0.01
    torch.testing.assert_close(cos, expected, atol=1e-5, rtol=0)
    resized = make_images(8, size=40)  # PIL resizes uint8 images with its own bicubic: rounding differences only
    torch.testing.assert_close(
        raw.score(resized, PROMPTS, [{}] * 8),
        clipscore_reference(tiny_clip_name, weights, resized),
        atol=1e-3,  # measured 7.6e-5 (uint8 tensor vs PIL bicubic)
        rtol=0,
    )


def test_clipscore_conventions(tmp_path: Path, tiny_clip_name, tiny_clip_state) -> None:
    weights = tmp_path / "open_clip_model.safetensors"
    save_file({k: v.contiguous() for k, v in tiny_clip_state.items()}, str(weights))
    raw = clipscore_mod.CLIPScoreReward(pretrained=str(weights), model_name=tiny_clip_name)
    raw.setup(torch.device("cpu"))
    images = make_images(8, size=40)
    cos = raw.score(images, PROMPTS, [{}] * 8)
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


def test_letterbox_needs_a_square_size_and_pads_with_black() -> None:
    from rlpost_rewards._common import clip_preprocess

    with pytest.raises(ValueError, match="square size"):
        clip_preprocess(make_images(1, size=32), (32, 48), OPENAI_MEAN, OPENAI_STD, resize_mode="longest")
    tall = torch.full((1, 32, 16, 3), 255, dtype=torch.uint8)  # white, half as wide as the target
    pixels = clip_preprocess(tall, 32, (0.0,) * 3, (1.0,) * 3, resize_mode="longest", float_resize=True)
    assert pixels.shape == (1, 3, 32, 32)
    assert torch.equal(pixels[..., :8], torch.zeros(1, 3, 32, 8)) and torch.equal(pixels[..., 24:], pixels[..., :8])
    torch.testing.assert_close(pixels[..., 8:24], torch.ones(1, 3, 32, 16))
