"""LAION aesthetic and PickScore through the production loaders, on tiny transformers CLIP models, against
computations that share no code with ``rlpost_rewards``:

* preprocessing: transformers' PIL image processor (``CLIPImageProcessorPil``) on PIL images, configured from the
  saved ``preprocessor_config.json``, instead of our batched uint8-tensor pipeline;
* embeddings: ``CLIPModel.get_image_features``/``get_text_features`` called directly, then L2-normalised;
* heads: PickScore's README (``yuvalkirstain/PickScore README.md@f79607f``: ``logit_scale.exp() * text_embs @
  image_embs.T``) and ddpo-pytorch's aesthetic scorer (``kvablack/ddpo-pytorch ddpo_pytorch/aesthetic_scorer.py
  @1958463``: normalised embedding through the Linear stack), restated on the raw state dict.

32 px inputs need no resize, so both paths see the same pixels: agreement to 1e-4 relative catches a wrong mean/std,
a skipped normalisation or projection, or a wrong head layer. Resized inputs agree to the rounding of uint8 resizing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import rlpost_rewards._hfclip as hfclip_mod
import rlpost_rewards.aesthetic as aesthetic_mod
from rlpost_rewards._paths import CheckpointNotFoundError
from rlpost_rewards.pickscore import PickScoreReward

from .checkpoints import write_aesthetic_files, write_clip_tokenizer, write_pickscore_dirs
from .conftest import PROMPTS, LoadCounter, check_reward_contract, make_images


def pil_pixels(processor_dir: Path, images: torch.Tensor) -> torch.Tensor:
    """Pixels from transformers' PIL-backend CLIP image processor loaded from ``processor_dir``."""
    from PIL import Image
    from transformers import CLIPImageProcessorPil

    processor = CLIPImageProcessorPil.from_pretrained(str(processor_dir))
    pixels: torch.Tensor = processor(images=[Image.fromarray(a) for a in images.numpy()], return_tensors="pt")[
        "pixel_values"
    ]
    return pixels


def _embeds(out: object) -> torch.Tensor:
    emb = out if isinstance(out, torch.Tensor) else out.pooler_output  # type: ignore[attr-defined]  # transformers 5
    return emb / torch.norm(emb, dim=-1, keepdim=True)


@pytest.fixture(scope="module")
def clip_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int]:
    """PickScore layout: a CLIPModel directory, and a tokenizer directory with a (non-OpenAI) processor config."""
    return write_pickscore_dirs(tmp_path_factory.mktemp("hfclip"))


@pytest.fixture(scope="module")
def aesthetic_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``openai/clip-vit-large-patch14`` layout (model + OpenAI processor config) and a random predictor head."""
    return write_aesthetic_files(tmp_path_factory.mktemp("aesthetic"))


def aesthetic_reference(clip_dir: Path, head_path: Path, images: torch.Tensor) -> torch.Tensor:
    """ddpo-pytorch ``AestheticScorer.__call__``: processor -> get_image_features -> L2 norm -> MLP."""
    from transformers import CLIPModel

    clip = CLIPModel.from_pretrained(str(clip_dir)).eval()
    head = torch.load(head_path, weights_only=True)
    with torch.no_grad():
        h = _embeds(clip.get_image_features(pixel_values=pil_pixels(clip_dir, images)))
        for j in (0, 2, 4, 6, 7):  # Linear layers of the nn.Sequential (1, 3, 5 are Dropout)
            h = F.linear(h, head[f"layers.{j}.weight"], head[f"layers.{j}.bias"])
    return h.squeeze(1)


def pickscore_reference(model_dir: Path, tok_dir: Path, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """PickScore README ``calc_probs`` before the softmax, for one prompt per image (the diagonal)."""
    from transformers import AutoTokenizer, CLIPModel

    model = CLIPModel.from_pretrained(str(model_dir)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    text = tokenizer(prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
    with torch.no_grad():
        image_embs = _embeds(model.get_image_features(pixel_values=pil_pixels(tok_dir, images)))
        text_embs = _embeds(model.get_text_features(**text))
        return model.logit_scale.exp() * torch.diagonal(text_embs @ image_embs.T)


def test_aesthetic_matches_ddpo_scorer(aesthetic_files, monkeypatch) -> None:
    clip_dir, head_path = aesthetic_files
    counter = LoadCounter(aesthetic_mod.load_aesthetic_head)
    monkeypatch.setattr(aesthetic_mod, "load_aesthetic_head", counter)
    reward = aesthetic_mod.AestheticReward(clip_dir=str(clip_dir), head=str(head_path))
    reward.setup(torch.device("cpu"))
    reward.setup(torch.device("cpu"))
    assert counter.calls == 1
    images = make_images(8, size=32)
    scores = check_reward_contract(reward, images, PROMPTS)
    expected = aesthetic_reference(clip_dir, head_path, images)
    assert expected.std() > 0.01  # measured 0.033: 300x the tolerance below
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-5)
    resized = make_images(8, size=48)
    torch.testing.assert_close(
        reward.score(resized, PROMPTS, [{}] * 8),
        aesthetic_reference(clip_dir, head_path, resized),
        rtol=0,
        atol=1e-3,  # measured 8.6e-5 (uint8 tensor vs PIL bicubic); mean/std 0.5 instead of OpenAI's moves it 2.5e-2
    )


def test_aesthetic_defaults_to_openai_statistics(aesthetic_files, tmp_path: Path) -> None:
    """Without ``preprocessor_config.json`` the reward falls back to OpenAI CLIP's mean/std and the model's size."""
    import shutil

    clip_dir, head_path = aesthetic_files
    bare = tmp_path / "bare"
    shutil.copytree(clip_dir, bare)
    (bare / "preprocessor_config.json").unlink()
    reward = aesthetic_mod.AestheticReward(clip_dir=str(bare), head=str(head_path))
    reward.setup(torch.device("cpu"))
    images = make_images(8, size=32)
    expected = aesthetic_reference(clip_dir, head_path, images)
    torch.testing.assert_close(reward.score(images, PROMPTS, [{}] * 8), expected, rtol=1e-4, atol=1e-5)


def test_aesthetic_head_formats_and_errors(tmp_path: Path, aesthetic_files, monkeypatch) -> None:
    from safetensors.torch import save_file

    clip_dir, _ = aesthetic_files
    head = aesthetic_mod.AestheticMLP(16)
    save_file(head.state_dict(), str(tmp_path / "head.safetensors"))
    loaded = aesthetic_mod.load_aesthetic_head(tmp_path / "head.safetensors")
    assert torch.equal(loaded.layers[7].weight, head.layers[7].weight)
    wrong = tmp_path / "wrong.pth"
    torch.save(aesthetic_mod.AestheticMLP(24).state_dict(), wrong)
    with pytest.raises(ValueError, match="24-d"):
        aesthetic_mod.AestheticReward(clip_dir=str(clip_dir), head=str(wrong)).setup(torch.device("cpu"))
    monkeypatch.setenv("RLPOST_MODELS", str(tmp_path))
    with pytest.raises(CheckpointNotFoundError, match="clip-vit-large-patch14.*directory|directory.*clip-vit-large"):
        aesthetic_mod.AestheticReward().setup(torch.device("cpu"))


def test_pickscore_matches_readme_computation(clip_dirs, monkeypatch) -> None:
    model_dir, tok_dir, _ = clip_dirs
    counter = LoadCounter(hfclip_mod.HFClip.load)
    monkeypatch.setattr(hfclip_mod.HFClip, "load", counter)
    reward = PickScoreReward(model_dir=str(model_dir), tokenizer_dir=str(tok_dir))
    reward.setup(torch.device("cpu"))
    reward.setup(torch.device("cpu"))
    assert counter.calls == 1
    assert reward._clip is not None and reward._clip.size == 32 and reward._clip.mean == (0.5, 0.5, 0.5)
    images = make_images(8, size=32)
    logits = check_reward_contract(reward, images, PROMPTS, tol=2e-4)  # logit_scale (~14) amplifies fp noise
    expected = pickscore_reference(model_dir, tok_dir, images, PROMPTS)
    assert expected.std() > 0.05
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    resized = make_images(8, size=48)
    torch.testing.assert_close(
        reward.score(resized, PROMPTS, [{}] * 8),
        pickscore_reference(model_dir, tok_dir, resized, PROMPTS),
        rtol=0,
        atol=1e-2,  # measured 8.4e-4 (uint8 tensor vs PIL bicubic, times logit_scale ~14)
    )


def test_pickscore_conventions(clip_dirs) -> None:
    model_dir, tok_dir, _ = clip_dirs
    images = make_images(8, size=32)
    logits = PickScoreReward(model_dir=str(model_dir), tokenizer_dir=str(tok_dir))
    logits.setup(torch.device("cpu"))
    scale = logits._logit_scale
    assert scale == pytest.approx(1 / 0.07, rel=1e-4)  # CLIP's initial logit scale
    logit = logits.score(images, PROMPTS, [{}] * 8)
    cosine = PickScoreReward(model_dir=str(model_dir), tokenizer_dir=str(tok_dir), convention="cosine")
    cosine.setup(torch.device("cpu"))
    torch.testing.assert_close(logit, scale * cosine.score(images, PROMPTS, [{}] * 8), atol=1e-4, rtol=0)
    flow = PickScoreReward(model_dir=str(model_dir), tokenizer_dir=str(tok_dir), convention="flow-grpo")
    flow.setup(torch.device("cpu"))
    torch.testing.assert_close(flow.score(images, PROMPTS, [{}] * 8), logit / 26, atol=1e-5, rtol=0)


def test_pickscore_rejects_tokenizer_with_wrong_vocab(tmp_path: Path, clip_dirs) -> None:
    model_dir, _, _ = clip_dirs
    small = tmp_path / "small_tok"
    write_clip_tokenizer(small, num_merges=10)
    with pytest.raises(ValueError, match="tokens but the text tower expects"):
        PickScoreReward(model_dir=str(model_dir), tokenizer_dir=str(small)).setup(torch.device("cpu"))


@pytest.mark.parametrize(
    ("change", "field"),
    [({"size": {"shortest_edge": 40}}, "size"), ({"size": 40}, "size"), ({"resample": 2}, "resample")],
)
def test_processor_config_we_cannot_follow_is_rejected(clip_dirs, tmp_path: Path, change: dict, field: str) -> None:
    model_dir, tok_dir, _ = clip_dirs
    cfg = json.loads((tok_dir / "preprocessor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(dict(cfg, **change)))
    clip = hfclip_mod.HFClip.load("pickscore", model_dir, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match=field):
        hfclip_mod.HFClip.load_preprocessing_from(clip, tmp_path)
