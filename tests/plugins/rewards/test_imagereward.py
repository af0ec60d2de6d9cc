"""ImageReward: the port (transformers ``BlipVisionModel``/``BlipTextModel`` + a key-renaming map) against code it
shares nothing with.

Why not the upstream package as the reference: ``image-reward`` 1.5 requires ``timm==0.6.13`` and
``fairscale==0.4.13`` (conflicting with ``constraints/cpu.txt``), imports OpenAI ``clip`` (not on PyPI), and its
``models/BLIP/med.py`` imports names transformers 5 removed, so CI cannot install or import it. Instead:

* ``data/imagereward_v1_shapes.json`` holds the state-dict names and shapes of upstream's own ``ImageReward`` module
  at full size, recorded by ``data/record_imagereward_shapes.py`` from the ``image-reward`` wheel. That is the key
  set of the released ``ImageReward.pt``; it must load strictly (checked on the meta device, no weights needed).
* :func:`upstream_shapes` (in ``checkpoints.py``, next to the tiny checkpoint builder) restates that module's names
  and shapes from the upstream source for any size; it must reproduce the recorded file at full size, and then gives
  tiny random checkpoints in the real format.
* :func:`upstream_score` restates ``ImageReward.score_gard`` (``THUDM/ImageReward ImageReward/ImageReward.py``,
  ``models/BLIP/vit.py``, ``models/BLIP/med.py`` @c1392c6) in plain ``torch.nn.functional`` on those names, and
  :func:`upstream_pixels` restates ``ImageReward._transform`` on PIL images. The production reward must agree with
  them to 1e-4 relative, which catches a wrong normalisation, a dropped projection or swapped layers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import rlpost_rewards.imagereward as ir
from rlpost_rewards._paths import CheckpointNotFoundError

from .checkpoints import upstream_shapes, write_imagereward_files
from .conftest import PROMPTS, LoadCounter, check_reward_contract, make_images

DATA = Path(__file__).parent / "data"
# ImageReward.py: ImageReward.__init__ and _transform.
IR_MEAN, IR_STD = 0.16717362830052426, 1.0333394966054072
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


# ----------------------------------------------------------------------------- restatement of upstream


def upstream_pixels(images: torch.Tensor, size: int) -> torch.Tensor:
    """``ImageReward._transform(size)`` on PIL images: Resize(bicubic) -> CenterCrop -> RGB -> ToTensor -> Normalize."""
    from PIL import Image
    from torchvision import transforms as T  # noqa: N812

    transform = T.Compose(
        [
            T.Resize(size, interpolation=T.InterpolationMode.BICUBIC),
            T.CenterCrop(size),
            T.ToTensor(),
            T.Normalize(CLIP_MEAN, CLIP_STD),
        ]
    )
    return torch.stack([transform(Image.fromarray(a).convert("RGB")) for a in images.numpy()])


def upstream_score(
    sd: dict[str, torch.Tensor], med: dict, pixels: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``ImageReward.score_gard``: ViT -> multimodal BERT (cross-attention to all image tokens) -> MLP on [CLS] ->
    ``(r - mean) / std``, on upstream parameter names."""

    def lin(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, sd[f"{name}.weight"], sd[f"{name}.bias"])

    def ln(x: torch.Tensor, name: str, eps: float) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], sd[f"{name}.weight"], sd[f"{name}.bias"], eps)

    def heads(x: torch.Tensor, n: int) -> torch.Tensor:  # [B, T, C] -> [B, n, T, C/n]
        return x.unflatten(-1, (n, -1)).transpose(1, 2)

    # vit.py VisionTransformer.forward (pre-norm blocks, eps 1e-6, scale head_dim^-0.5, exact GELU)
    v = "blip.visual_encoder"
    w = sd[f"{v}.patch_embed.proj.weight"]
    x = F.conv2d(pixels, w, sd[f"{v}.patch_embed.proj.bias"], stride=w.shape[-1]).flatten(2).transpose(1, 2)
    x = torch.cat([sd[f"{v}.cls_token"].expand(x.shape[0], -1, -1), x], dim=1)
    x = x + sd[f"{v}.pos_embed"][:, : x.shape[1]]
    nh = sd[f"{v}.cls_token"].shape[-1] // 64
    for i in range(len({k.split(".")[3] for k in sd if k.startswith(f"{v}.blocks.")})):
        b = f"{v}.blocks.{i}"
        q, k, val = lin(ln(x, f"{b}.norm1", 1e-6), f"{b}.attn.qkv").chunk(3, dim=-1)
        q, k, val = heads(q, nh), heads(k, nh), heads(val, nh)
        attn = ((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5).softmax(-1)
        x = x + lin((attn @ val).transpose(1, 2).flatten(2), f"{b}.attn.proj")
        x = x + lin(F.gelu(lin(ln(x, f"{b}.norm2", 1e-6), f"{b}.mlp.fc1")), f"{b}.mlp.fc2")
    image = ln(x, f"{v}.norm", 1e-6)

    # med.py BertModel.forward(mode="multimodal"): post-norm layers, encoder mask (1 - m) * -10000, all-ones image mask
    t, eps, nt = "blip.text_encoder", med["layer_norm_eps"], med["num_attention_heads"]
    positions = sd[f"{t}.embeddings.position_ids"][:, : ids.shape[1]]
    y = sd[f"{t}.embeddings.word_embeddings.weight"][ids] + sd[f"{t}.embeddings.position_embeddings.weight"][positions]
    y = ln(y, f"{t}.embeddings.LayerNorm", eps)
    additive = (1.0 - mask[:, None, None, :].float()) * -10000.0

    def bert_attention(y: torch.Tensor, ctx: torch.Tensor, pre: str, bias: torch.Tensor | None) -> torch.Tensor:
        q, k = heads(lin(y, f"{pre}.self.query"), nt), heads(lin(ctx, f"{pre}.self.key"), nt)
        val = heads(lin(ctx, f"{pre}.self.value"), nt)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        probs = (scores if bias is None else scores + bias).softmax(-1)
        context = (probs @ val).transpose(1, 2).flatten(2)
        return ln(lin(context, f"{pre}.output.dense") + y, f"{pre}.output.LayerNorm", eps)

    for i in range(med["num_hidden_layers"]):
        layer = f"{t}.encoder.layer.{i}"
        y = bert_attention(y, y, f"{layer}.attention", additive)
        y = bert_attention(y, image, f"{layer}.crossattention", None)
        hidden = F.gelu(lin(y, f"{layer}.intermediate.dense"))
        y = ln(lin(hidden, f"{layer}.output.dense") + y, f"{layer}.output.LayerNorm", eps)

    r = y[:, 0, :].float()
    for j in (0, 2, 4, 6, 7):  # MLP: Linear/Dropout stack, no non-linearity
        r = lin(r, f"mlp.layers.{j}")
    return ((r - IR_MEAN) / IR_STD).squeeze(1)


def upstream_tokenize(tok_dir: Path, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """``blip.init_tokenizer`` + ``ImageReward.score``'s call (max_length padding to 35, truncation)."""
    from transformers import BertTokenizer

    tokenizer = BertTokenizer.from_pretrained(str(tok_dir))
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    out = tokenizer(prompts, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    return out["input_ids"], out["attention_mask"]


# --------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def ir_files(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Tiny ``ImageReward.pt`` (upstream names, random weights), ``med_config.json`` and a BERT tokenizer dir."""
    return write_imagereward_files(tmp_path_factory.mktemp("imagereward"))


# ------------------------------------------------------------------------------------------------ tests


def test_restated_key_set_equals_upstream_module() -> None:
    recorded = json.loads((DATA / "imagereward_v1_shapes.json").read_text())
    vit_large = {"image_size": 224, "patch_size": 16, "width": 1024, "depth": 24, "mlp_ratio": 4}  # create_vit "large"
    assert upstream_shapes(vit_large, recorded["med_config"]) == recorded["state_dict_shapes"]


def test_released_key_set_loads_strictly() -> None:
    """Every key of the released checkpoint's format maps to a parameter of the port with the same shape, and every
    parameter of the port is covered (on the meta device: names and shapes only)."""
    recorded = json.loads((DATA / "imagereward_v1_shapes.json").read_text())
    state = {k: torch.empty(s, device="meta") for k, s in recorded["state_dict_shapes"].items()}
    model = ir.imagereward_from_state_dict(state, recorded["med_config"], "ImageReward.pt key set")
    assert model.image_size == 224 and model.vision.config.num_attention_heads == 16
    assert model.text.config.encoder_hidden_size == 1024 and model.text.config.num_hidden_layers == 12
    used = {k: s for k, s in recorded["state_dict_shapes"].items() if k not in ir.UNUSED_UPSTREAM_KEYS}
    assert sum(p.numel() for p in model.parameters()) == sum(math.prod(s) for s in used.values())
    assert set(ir.UNUSED_UPSTREAM_KEYS) <= set(recorded["state_dict_shapes"])


@pytest.mark.parametrize(
    ("upstream", "ours"),
    [
        ("blip.visual_encoder.cls_token", "vision.embeddings.class_embedding"),
        ("blip.visual_encoder.pos_embed", "vision.embeddings.position_embedding"),
        ("blip.visual_encoder.patch_embed.proj.weight", "vision.embeddings.patch_embedding.weight"),
        ("blip.visual_encoder.blocks.11.norm1.bias", "vision.encoder.layers.11.layer_norm1.bias"),
        ("blip.visual_encoder.blocks.3.norm2.weight", "vision.encoder.layers.3.layer_norm2.weight"),
        ("blip.visual_encoder.blocks.0.attn.qkv.weight", "vision.encoder.layers.0.self_attn.qkv.weight"),
        ("blip.visual_encoder.blocks.23.attn.proj.bias", "vision.encoder.layers.23.self_attn.projection.bias"),
        ("blip.visual_encoder.blocks.2.mlp.fc2.weight", "vision.encoder.layers.2.mlp.fc2.weight"),
        ("blip.visual_encoder.norm.weight", "vision.post_layernorm.weight"),
        ("blip.text_encoder.embeddings.LayerNorm.bias", "text.embeddings.LayerNorm.bias"),
        (
            "blip.text_encoder.encoder.layer.7.crossattention.self.key.weight",
            "text.encoder.layer.7.crossattention.self.key.weight",
        ),
        ("mlp.layers.6.weight", "head.layers.6.weight"),
        ("blip.vision_proj.weight", None),
        ("blip.text_proj.bias", None),
        ("blip.text_encoder.embeddings.position_ids", None),
    ],
)
def test_key_map(upstream: str, ours: str | None) -> None:
    assert ir.upstream_to_port_key(upstream) == ours


def test_key_map_rejects_unknown_names() -> None:
    for key in (
        "blip.visual_encoder.head.weight",
        "blip.text_encoder.pooler.dense.weight",
        "blip.text_encoder.embeddings.token_type_embeddings.weight",
        "blip.text_encoder.encoder.layer.0.attention.self.distance_embedding.weight",
        "mlp.layers.1.weight",
    ):
        with pytest.raises(KeyError):
            ir.upstream_to_port_key(key)


def test_imagereward_matches_upstream_restatement(ir_files, monkeypatch) -> None:
    """Production path (files under $RLPOST_MODELS, tokenizer, batched tensor preprocessing) vs the restatement of
    upstream's tokenizer, PIL transform and forward. 32 px inputs need no resize, so both paths see the same pixels
    and must agree to fp32 rounding."""
    counter = LoadCounter(ir.load_imagereward)
    monkeypatch.setattr(ir, "load_imagereward", counter)
    monkeypatch.setenv("RLPOST_MODELS", str(ir_files["root"]))  # default names: ImageReward/..., bert-base-uncased/
    reward = ir.ImageRewardReward()
    reward.setup(torch.device("cpu"))
    reward.setup(torch.device("cpu"))
    assert counter.calls == 1
    images = make_images(8, size=32)
    scores = check_reward_contract(reward, images, PROMPTS)
    ids, mask = upstream_tokenize(ir_files["tok"], PROMPTS)
    assert ids.shape == (8, 35) and (ids != 1).sum() > 8 * 4  # real words, not [UNK]
    with torch.no_grad():
        expected = upstream_score(ir_files["state"], ir_files["med"], upstream_pixels(images, 32), ids, mask)
    assert expected.std() > 0.1  # the random model discriminates, so a wrong input would show
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-5)


def test_imagereward_resized_inputs_close_to_pil_path(ir_files) -> None:
    """48 px inputs are resized: our uint8 tensor bicubic differs from PIL's only by rounding."""
    reward = ir.ImageRewardReward(
        checkpoint=str(ir_files["ckpt"]),
        med_config=str(ir_files["root"] / "ImageReward" / "med_config.json"),
        tokenizer_dir=str(ir_files["tok"]),
    )
    reward.setup(torch.device("cpu"))
    images = make_images(8, size=48)
    scores = reward.score(images, PROMPTS, [{}] * 8)
    ids, mask = upstream_tokenize(ir_files["tok"], PROMPTS)
    with torch.no_grad():
        expected = upstream_score(ir_files["state"], ir_files["med"], upstream_pixels(images, 32), ids, mask)
    torch.testing.assert_close(scores, expected, rtol=0, atol=5e-3)  # measured 4.4e-4; scores spread ~0.5


def test_imagereward_ddp_prefix_and_unknown_keys(ir_files, tmp_path: Path) -> None:
    med_path = ir_files["root"] / "ImageReward" / "med_config.json"
    prefixed = {f"module.{k}": v for k, v in ir_files["state"].items()}
    torch.save(prefixed, tmp_path / "ddp.pt")
    a, _ = ir.load_imagereward(tmp_path / "ddp.pt", med_path)
    b, _ = ir.load_imagereward(ir_files["ckpt"], med_path)
    assert torch.equal(a.head.layers[7].weight, b.head.layers[7].weight)
    extra = dict(ir_files["state"], **{"blip.itm_head.weight": torch.zeros(2, 32)})
    torch.save(extra, tmp_path / "extra.pt")
    with pytest.raises(ValueError, match=r"does not have: \['blip.itm_head.weight'\]"):
        ir.load_imagereward(tmp_path / "extra.pt", med_path)


def test_imagereward_tokenizer_vocab_check(ir_files, tmp_path: Path) -> None:
    from transformers import BertTokenizer

    (tmp_path / "v.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n")  # BERT's special tokens only
    BertTokenizer(str(tmp_path / "v.txt")).save_pretrained(str(tmp_path / "tok"))
    reward = ir.ImageRewardReward(
        checkpoint=str(ir_files["ckpt"]),
        med_config=str(ir_files["root"] / "ImageReward" / "med_config.json"),
        tokenizer_dir=str(tmp_path / "tok"),
    )
    with pytest.raises(ValueError, match="7 tokens"):
        reward.setup(torch.device("cpu"))


def test_imagereward_missing_files_and_parameters(tmp_path: Path, ir_files) -> None:
    with pytest.raises(CheckpointNotFoundError, match=r"ImageReward\.pt.*THUDM/ImageReward"):
        ir.ImageRewardReward(checkpoint=str(tmp_path / "ImageReward.pt")).setup(torch.device("cpu"))
    med_path = ir_files["root"] / "ImageReward" / "med_config.json"
    bad = dict(ir_files["state"])
    del bad["blip.text_encoder.encoder.layer.1.crossattention.self.key.weight"]
    torch.save(bad, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="missing parameters"):
        ir.load_imagereward(tmp_path / "bad.pt", med_path)
    wrong_med = tmp_path / "med.json"
    wrong_med.write_text(json.dumps(dict(ir_files["med"], intermediate_size=48)))
    with pytest.raises(ValueError, match="shape mismatch"):
        ir.load_imagereward(ir_files["ckpt"], wrong_med)
