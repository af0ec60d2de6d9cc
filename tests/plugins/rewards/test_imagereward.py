"""ImageReward: tiny random checkpoint in the real format (``blip.*`` + ``mlp.layers.*``, ``med_config.json``, a
BERT ``vocab.txt``), loaded through the production loader and checked against an independent computation built
from timm's ViT (same parameter names as BLIP's) and ``torch.nn.MultiheadAttention``."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import rlpost_rewards.imagereward as ir
from rlpost_rewards._common import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, clip_preprocess
from rlpost_rewards._paths import CheckpointNotFoundError

from .conftest import PROMPTS, LoadCounter, check_reward_contract, make_images

WORDS = "a photo of cat red car on street an astronaut riding horse bowl fruit watercolor painting mountains dog"
WORDS += " wearing sunglasses city at night plate sushi the"
MED = {
    "hidden_size": 32,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "intermediate_size": 64,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-12,
    "max_position_embeddings": 40,
    "pad_token_id": 0,
    "type_vocab_size": 2,
    "add_cross_attention": True,
    "encoder_width": 768,
}
VIT = {"image_size": 32, "patch_size": 8, "width": 128, "depth": 2}  # heads = width / 64 = 2


@pytest.fixture(scope="module")
def ir_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from transformers import BertTokenizer

    root = tmp_path_factory.mktemp("imagereward")
    raw = root / "raw_vocab.txt"
    vocab = [
        "[PAD]",
        "[UNK]",
        "[CLS]",
        "[SEP]",
        "[MASK]",
        *sorted(set(WORDS.split()) | set("bcdefghijklmnopqrstuvwxyz")),
    ]
    raw.write_text("\n".join(vocab) + "\n")
    tok_dir = root / "bert-base-uncased"
    BertTokenizer(str(raw)).save_pretrained(str(tok_dir))
    med = dict(MED, vocab_size=len(vocab) + 2)  # + BLIP's [DEC] and [ENC]
    (root / "ImageReward").mkdir()
    (root / "ImageReward" / "med_config.json").write_text(json.dumps(med))
    torch.manual_seed(0)
    vision = ir.BlipVisionTransformer(VIT["image_size"], VIT["patch_size"], VIT["width"], VIT["depth"], 2)
    model = ir.ImageRewardModel(vision, ir.MedBertModel(dict(med, encoder_width=VIT["width"])))
    state = {k: torch.randn_like(v) * 0.2 for k, v in model.state_dict().items()}
    # keys the released checkpoint carries that score() never uses
    state["blip.vision_proj.weight"] = torch.zeros(8, VIT["width"])
    state["blip.text_encoder.embeddings.position_ids"] = torch.arange(40)[None]
    torch.save(state, root / "ImageReward" / "ImageReward.pt")
    return {"root": root, "tok": tok_dir, "ckpt": root / "ImageReward" / "ImageReward.pt", "state": state}  # type: ignore[dict-item]


def _reference(state: dict[str, torch.Tensor], med: dict, pixels: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor):  # noqa: ANN201
    """Independent forward: timm ViT for ``blip.visual_encoder``; nn.MultiheadAttention-based med BERT."""
    from timm.models.vision_transformer import VisionTransformer

    vit = VisionTransformer(
        img_size=VIT["image_size"], patch_size=VIT["patch_size"], embed_dim=VIT["width"], depth=VIT["depth"],
        num_heads=2, num_classes=0, global_pool="", qkv_bias=True, norm_layer=partial(nn.LayerNorm, eps=1e-6),
    ).eval()  # fmt: skip
    vit.load_state_dict({k.removeprefix("blip.visual_encoder."): v for k, v in state.items() if "visual_encoder" in k})
    img = vit.forward_features(pixels)

    def p(name: str) -> torch.Tensor:
        return state[f"blip.text_encoder.{name}"]

    def ln(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], p(f"{name}.weight"), p(f"{name}.bias"), eps=1e-12)

    def attend(x: torch.Tensor, ctx: torch.Tensor, pre: str, pad: torch.Tensor | None) -> torch.Tensor:
        d, kd = x.shape[-1], ctx.shape[-1]
        mha = nn.MultiheadAttention(d, med["num_attention_heads"], kdim=kd, vdim=kd, batch_first=True)
        with torch.no_grad():
            qkv = [p(f"{pre}.self.{n}.weight") for n in ("query", "key", "value")]
            if mha.in_proj_weight is not None:  # packed when key width == query width
                mha.in_proj_weight.copy_(torch.cat(qkv))
            else:
                mha.q_proj_weight.copy_(qkv[0])
                mha.k_proj_weight.copy_(qkv[1])
                mha.v_proj_weight.copy_(qkv[2])
            mha.in_proj_bias.copy_(torch.cat([p(f"{pre}.self.{n}.bias") for n in ("query", "key", "value")]))
            mha.out_proj.weight.copy_(torch.eye(d))
            mha.out_proj.bias.zero_()
        out = mha(x, ctx, ctx, key_padding_mask=pad, need_weights=False)[0]
        return ln(
            F.linear(out, p(f"{pre}.output.dense.weight"), p(f"{pre}.output.dense.bias")) + x, f"{pre}.output.LayerNorm"
        )

    x = p("embeddings.word_embeddings.weight")[ids] + p("embeddings.position_embeddings.weight")[: ids.shape[1]]
    x = ln(x, "embeddings.LayerNorm")
    for i in range(med["num_hidden_layers"]):
        pre = f"encoder.layer.{i}"
        x = attend(x, x, f"{pre}.attention", mask == 0)
        x = attend(x, img, f"{pre}.crossattention", None)
        h = F.gelu(F.linear(x, p(f"{pre}.intermediate.dense.weight"), p(f"{pre}.intermediate.dense.bias")))
        x = ln(
            F.linear(h, p(f"{pre}.output.dense.weight"), p(f"{pre}.output.dense.bias")) + x, f"{pre}.output.LayerNorm"
        )
    h = x[:, 0]
    for j in (0, 2, 4, 6, 7):
        h = F.linear(h, state[f"mlp.layers.{j}.weight"], state[f"mlp.layers.{j}.bias"])
    return (h.squeeze(1) - 0.16717362830052426) / 1.0333394966054072


def test_imagereward_matches_independent_forward(ir_files, monkeypatch) -> None:
    counter = LoadCounter(ir.load_imagereward)
    monkeypatch.setattr(ir, "load_imagereward", counter)
    monkeypatch.setenv("RLPOST_MODELS", str(ir_files["root"]))  # default names: ImageReward/..., bert-base-uncased/
    reward = ir.ImageRewardReward()
    reward.setup(torch.device("cpu"))
    reward.setup(torch.device("cpu"))
    images = make_images(8, size=48)
    scores = check_reward_contract(reward, images, PROMPTS)
    assert counter.calls == 1
    tokens = reward._tokenizer(PROMPTS, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    assert tokens["input_ids"].shape == (8, 35) and (tokens["input_ids"] != 1).sum() > 8 * 4  # real words, not [UNK]
    med = json.loads((ir_files["root"] / "ImageReward" / "med_config.json").read_text())
    pixels = clip_preprocess(images, 32, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)
    with torch.no_grad():
        expected = _reference(ir_files["state"], med, pixels, tokens["input_ids"], tokens["attention_mask"])
    torch.testing.assert_close(scores, expected, atol=1e-4, rtol=1e-4)


def test_imagereward_tokenizer_vocab_check(ir_files, tmp_path: Path) -> None:
    from transformers import BertTokenizer

    (tmp_path / "v.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n")  # what a failed hub lookup gives
    BertTokenizer(str(tmp_path / "v.txt")).save_pretrained(str(tmp_path / "tok"))
    reward = ir.ImageRewardReward(
        checkpoint=str(ir_files["ckpt"]),
        med_config=str(ir_files["root"] / "ImageReward" / "med_config.json"),
        tokenizer_dir=str(tmp_path / "tok"),
    )
    with pytest.raises(ValueError, match="7 tokens"):
        reward.setup(torch.device("cpu"))


def test_imagereward_missing_files(tmp_path: Path, ir_files) -> None:
    with pytest.raises(CheckpointNotFoundError, match=r"ImageReward\.pt.*THUDM/ImageReward"):
        ir.ImageRewardReward(checkpoint=str(tmp_path / "ImageReward.pt")).setup(torch.device("cpu"))
    bad = dict(ir_files["state"])
    del bad["blip.text_encoder.encoder.layer.1.crossattention.self.key.weight"]
    torch.save(bad, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="missing parameters"):
        ir.load_imagereward(tmp_path / "bad.pt", ir_files["root"] / "ImageReward" / "med_config.json")
