"""ImageReward (Xu et al. 2023, ``THUDM/ImageReward``) re-implemented on plain torch so it loads the released
``ImageReward.pt`` + ``med_config.json`` without the ``image-reward`` package.

Why not the package: it pins a 2023 stack; under transformers 5 it needs a ~40-line monkeypatch of
``transformers.modeling_utils`` plus a replaced tokenizer initialiser, it imports OpenAI ``clip`` (and through it
``pkg_resources``, gone from setuptools>=81), and it fetches ``bert-base-uncased`` from the hub (feasibility.md 1.4,
Appendix B). Following feasibility.md's recommendation we restate the three pieces ImageReward's ``score`` uses,
keeping the checkpoint's parameter names so the real file loads strictly:

* ``blip.visual_encoder``: BLIP's ViT (timm-style pre-norm blocks, LayerNorm eps 1e-6, qkv bias, cls token, final
  norm). ViT-L/16 at 224 px in the release; width/depth/patch/size are read from the checkpoint, heads = width/64.
* ``blip.text_encoder``: BLIP's "med" BERT: word + absolute position embeddings (no token types), post-norm layers
  of self-attention, cross-attention to all image tokens (every layer; ``mode="multimodal"``) and a GELU MLP.
* ``mlp``: 768→1024→128→64→16→1 linear head (same layout as the LAION aesthetic head).

Score (``ImageReward.score``): tokenise the prompt (``padding="max_length"``, ``max_length=35``, truncation), take
the text encoder's ``[CLS]`` state, apply the head, standardise ``(r - 0.16717362830052426) / 1.0333394966054072``.
Typical values: SD3.5-M ≈ 0.89, RL-tuned ≈ 1.2-1.4 (algorithms.md 8.2).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

from rlpost.api import RewardSource

from ._common import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, DTypeName, check_images, check_scores, clip_preprocess, to_dtype
from ._paths import PathSpec, path_problems, resolve_path

__all__ = ["BlipVisionTransformer", "ImageRewardModel", "ImageRewardReward", "MedBertModel", "load_imagereward"]

DEFAULT_CHECKPOINT = "ImageReward/ImageReward.pt"
DEFAULT_MED_CONFIG = "ImageReward/med_config.json"
DEFAULT_TOKENIZER_DIR = "bert-base-uncased"
OBTAIN = "https://huggingface.co/THUDM/ImageReward (files ImageReward.pt and med_config.json)"
OBTAIN_TOKENIZER = "https://huggingface.co/google-bert/bert-base-uncased (vocab.txt, tokenizer_config.json)"

# ImageReward.py: reward standardisation constants of the released model.
REWARD_MEAN = 0.16717362830052426
REWARD_STD = 1.0333394966054072
MAX_PROMPT_TOKENS = 35


# --------------------------------------------------------------------------------------------- vision tower


class _VitAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = ((q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5).softmax(dim=-1)
        out: Tensor = self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))
        return out


class _VitMlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.fc2(F.gelu(self.fc1(x)))
        return out


class _VitBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = _VitAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = _VitMlp(dim, int(dim * mlp_ratio))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class _PatchEmbed(nn.Module):
    def __init__(self, patch: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.proj(x).flatten(2).transpose(1, 2)
        return out


class BlipVisionTransformer(nn.Module):
    """BLIP's ViT (``models/BLIP/vit.py``), inference only; parameter names match ``blip.visual_encoder.*``.

    Args:
        image_size: Input side in pixels.
        patch_size: Patch side.
        width: Embedding width.
        depth: Number of blocks.
        heads: Attention heads.
        mlp_ratio: MLP hidden width / ``width``.
    """

    def __init__(
        self, image_size: int = 224, patch_size: int = 16, width: int = 1024, depth: int = 24, heads: int = 16,
        mlp_ratio: float = 4.0,
    ) -> None:  # fmt: skip
        super().__init__()
        self.image_size = image_size
        self.patch_embed = _PatchEmbed(patch_size, width)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, width))
        self.pos_embed = nn.Parameter(torch.zeros(1, (image_size // patch_size) ** 2 + 1, width))
        self.blocks = nn.ModuleList([_VitBlock(width, heads, mlp_ratio) for _ in range(depth)])
        self.norm = nn.LayerNorm(width, eps=1e-6)

    def forward(self, pixels: Tensor) -> Tensor:
        """``[B, 3, H, W]`` normalised pixels -> ``[B, 1 + patches, width]`` token states."""
        x = self.patch_embed(pixels)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + self.pos_embed[:, : x.shape[1]]
        for block in self.blocks:
            x = block(x)
        out: Tensor = self.norm(x)
        return out


# ----------------------------------------------------------------------------------------------- text tower


class _BertAttentionCore(nn.Module):  # "self" in the checkpoint names
    def __init__(self, hidden: int, heads: int, kv_width: int) -> None:
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(kv_width, hidden)
        self.value = nn.Linear(kv_width, hidden)

    def forward(self, x: Tensor, context: Tensor, additive_mask: Tensor | None) -> Tensor:
        b, n, c = x.shape
        d = c // self.heads

        def split(t: Tensor) -> Tensor:
            return t.view(b, -1, self.heads, d).transpose(1, 2)

        scores = split(self.query(x)) @ split(self.key(context)).transpose(-1, -2) / math.sqrt(d)
        if additive_mask is not None:
            scores = scores + additive_mask
        return (scores.softmax(dim=-1) @ split(self.value(context))).transpose(1, 2).reshape(b, n, c)


class _BertSelfOutput(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)  # noqa: N815 - checkpoint name

    def forward(self, x: Tensor, residual: Tensor) -> Tensor:
        out: Tensor = self.LayerNorm(self.dense(x) + residual)
        return out


class _BertAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_width: int, eps: float) -> None:
        super().__init__()
        self.self = _BertAttentionCore(hidden, heads, kv_width)
        self.output = _BertSelfOutput(hidden, eps)

    def forward(self, x: Tensor, context: Tensor, additive_mask: Tensor | None) -> Tensor:
        out: Tensor = self.output(self.self(x, context, additive_mask), x)
        return out


class _BertIntermediate(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, intermediate)

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.dense(x))  # med_config hidden_act "gelu" = exact erf GELU


class _BertOutput(nn.Module):
    def __init__(self, intermediate: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(intermediate, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)  # noqa: N815 - checkpoint name

    def forward(self, x: Tensor, residual: Tensor) -> Tensor:
        out: Tensor = self.LayerNorm(self.dense(x) + residual)
        return out


class _BertLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden, heads, eps = cfg["hidden_size"], cfg["num_attention_heads"], cfg.get("layer_norm_eps", 1e-12)
        self.attention = _BertAttention(hidden, heads, hidden, eps)
        self.crossattention = _BertAttention(hidden, heads, cfg["encoder_width"], eps)
        self.intermediate = _BertIntermediate(hidden, cfg["intermediate_size"])
        self.output = _BertOutput(cfg["intermediate_size"], hidden, eps)

    def forward(self, x: Tensor, text_mask: Tensor, image_states: Tensor) -> Tensor:
        x = self.attention(x, x, text_mask)
        x = self.crossattention(x, image_states, None)  # all image tokens attended (encoder mask of ones)
        out: Tensor = self.output(self.intermediate(x), x)
        return out


class _BertEmbeddings(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.word_embeddings = nn.Embedding(cfg["vocab_size"], hidden, padding_idx=cfg.get("pad_token_id", 0))
        self.position_embeddings = nn.Embedding(cfg["max_position_embeddings"], hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=cfg.get("layer_norm_eps", 1e-12))  # noqa: N815 - checkpoint name

    def forward(self, input_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        out: Tensor = self.LayerNorm(self.word_embeddings(input_ids) + self.position_embeddings(positions)[None])
        return out


class _BertEncoder(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.layer = nn.ModuleList([_BertLayer(cfg) for _ in range(cfg["num_hidden_layers"])])


class MedBertModel(nn.Module):
    """BLIP's multimodal BERT encoder (``models/BLIP/med.py``, ``mode="multimodal"``), inference only; parameter
    names match ``blip.text_encoder.*``.

    Args:
        config: ``med_config.json`` contents with ``encoder_width`` set to the vision width.
    """

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.config = dict(config)
        self.embeddings = _BertEmbeddings(config)
        self.encoder = _BertEncoder(config)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, image_states: Tensor) -> Tensor:
        """Last hidden states ``[B, T, hidden]``."""
        x = self.embeddings(input_ids)
        # med.get_extended_attention_mask (encoder, not decoder): (1 - mask) * -10000 broadcast over heads/queries.
        additive = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -10000.0
        for layer in self.encoder.layer:
            x = layer(x, additive, image_states)
        return x


class _Blip(nn.Module):
    def __init__(self, vision: BlipVisionTransformer, text: MedBertModel) -> None:
        super().__init__()
        self.visual_encoder = vision
        self.text_encoder = text


class ImageRewardModel(nn.Module):
    """ViT + med BERT + MLP head with ImageReward's parameter names (``blip.*``, ``mlp.layers.*``).

    Args:
        vision: The BLIP vision transformer.
        text: The multimodal BERT.
    """

    def __init__(self, vision: BlipVisionTransformer, text: MedBertModel) -> None:
        super().__init__()
        from .aesthetic import AestheticMLP  # same head layout as the LAION aesthetic predictor

        self.blip = _Blip(vision, text)
        self.mlp = AestheticMLP(int(text.config["hidden_size"]))

    def forward(self, pixels: Tensor, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Standardised reward ``[B]`` (``ImageReward.score``)."""
        image_states = self.blip.visual_encoder(pixels)
        text_states = self.blip.text_encoder(input_ids, attention_mask, image_states)
        raw = self.mlp(text_states[:, 0, :].float()).squeeze(1)
        return (raw - REWARD_MEAN) / REWARD_STD


def load_imagereward(
    checkpoint: str | os.PathLike[str], med_config: str | os.PathLike[str]
) -> tuple[ImageRewardModel, dict[str, Any]]:
    """Build the model sized from ``med_config.json`` and the checkpoint's shapes, then load it strictly.

    The checkpoint is read with ``torch.load(weights_only=True)`` (or safetensors). Keys ImageReward carries but
    ``score`` never uses (``blip.vision_proj``, ``blip.text_proj``, position-id buffers, ...) are ignored; any
    parameter of ours missing from the file is an error.

    Returns:
        The model (eval mode, on CPU) and the effective med config.
    """
    from ._common import load_state_dict_file

    state = load_state_dict_file(checkpoint)
    cfg: dict[str, Any] = json.loads(Path(med_config).read_text())
    try:
        patch = state["blip.visual_encoder.patch_embed.proj.weight"]
        pos = state["blip.visual_encoder.pos_embed"]
    except KeyError as err:
        raise ValueError(f"{checkpoint}: not an ImageReward checkpoint (missing {err})") from err
    width, patch_size = int(patch.shape[0]), int(patch.shape[-1])
    image_size = int(round(math.sqrt(pos.shape[1] - 1))) * patch_size
    depth = len({k.split(".")[3] for k in state if k.startswith("blip.visual_encoder.blocks.")})
    mlp_hidden = int(state["blip.visual_encoder.blocks.0.mlp.fc1.weight"].shape[0])
    vision = BlipVisionTransformer(image_size, patch_size, width, depth, max(1, width // 64), mlp_hidden / width)
    cfg["encoder_width"] = width  # blip_pretrain.py: encoder_config.encoder_width = vision_width
    model = ImageRewardModel(vision, MedBertModel(cfg))
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    if missing:
        raise ValueError(f"{checkpoint}: missing parameters {missing[:8]} (checkpoint/med_config mismatch?)")
    wrong = [k for k in own if tuple(state[k].shape) != tuple(own[k].shape)]
    if wrong:
        raise ValueError(f"{checkpoint}: shape mismatch for {wrong[:8]} (does med_config.json match?)")
    model.load_state_dict({k: state[k] for k in own})
    return model.eval().requires_grad_(False), cfg


def load_blip_tokenizer(tokenizer_dir: str | os.PathLike[str], expected_vocab: int) -> Any:
    """``bert-base-uncased`` tokenizer from a local directory plus BLIP's ``[DEC]`` and ``[ENC]`` tokens
    (``blip.init_tokenizer``), checked against the text tower's vocabulary size (30524 for the release)."""
    from transformers import BertTokenizer

    tokenizer = BertTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_tokens(["[ENC]"], special_tokens=True)
    # A failed hub lookup silently yields a 5-token vocabulary mapping every word to [UNK] (feasibility.md 4).
    if len(tokenizer) != expected_vocab:
        raise ValueError(
            f"image-reward: tokenizer from {tokenizer_dir} has {len(tokenizer)} tokens after adding [DEC]/[ENC], "
            f"but med_config.json says vocab_size={expected_vocab}; point tokenizer_dir at bert-base-uncased"
        )
    return tokenizer


class ImageRewardReward(RewardSource):
    """ImageReward v1.0 score of each (image, prompt) pair (standardised; ≈ -2..2).

    Args:
        checkpoint: ``ImageReward.pt``; default ``$RLPOST_MODELS/ImageReward/ImageReward.pt``.
        med_config: ``med_config.json``; default ``$RLPOST_MODELS/ImageReward/med_config.json``.
        tokenizer_dir: Local ``bert-base-uncased`` tokenizer directory; default ``$RLPOST_MODELS/bert-base-uncased``.
        dtype: Compute dtype of the towers (the head runs in fp32; scores are returned in fp32).
    """

    name: ClassVar[str] = "image-reward"

    def __init__(
        self,
        checkpoint: str | None = None,
        med_config: str | None = None,
        tokenizer_dir: str | None = None,
        dtype: DTypeName = "float32",
    ) -> None:
        self.checkpoint = checkpoint
        self.med_config = med_config
        self.tokenizer_dir = tokenizer_dir
        self.dtype = to_dtype(dtype)
        self._model: ImageRewardModel | None = None
        self._tokenizer: Any = None
        self._device = torch.device("cpu")

    def validate(self, recipe: Any) -> list[str]:
        """The checkpoint, its config and the tokenizer must be installed (file checks; nothing loads)."""
        return path_problems(
            self,
            recipe,
            [
                PathSpec("checkpoint", self.checkpoint, DEFAULT_CHECKPOINT, "checkpoint", OBTAIN),
                PathSpec("med_config", self.med_config, DEFAULT_MED_CONFIG, "med config", OBTAIN),
                PathSpec(
                    "tokenizer_dir", self.tokenizer_dir, DEFAULT_TOKENIZER_DIR, "BERT tokenizer", OBTAIN_TOKENIZER, True
                ),
            ],
        )

    def setup(self, device: torch.device) -> None:
        """Load the checkpoint and tokenizer from local files onto ``device`` (once)."""
        if self._model is not None:
            return
        ckpt = resolve_path(self.checkpoint, DEFAULT_CHECKPOINT, reward=self.name, what="checkpoint", obtain=OBTAIN)
        med = resolve_path(self.med_config, DEFAULT_MED_CONFIG, reward=self.name, what="med config", obtain=OBTAIN)
        tok = resolve_path(
            self.tokenizer_dir,
            DEFAULT_TOKENIZER_DIR,
            reward=self.name,
            what="BERT tokenizer",
            obtain=OBTAIN_TOKENIZER,
            is_dir=True,
        )
        model, cfg = load_imagereward(ckpt, med)
        self._tokenizer = load_blip_tokenizer(tok, int(cfg["vocab_size"]))
        self._device = torch.device(device)
        model.blip.to(device=self._device, dtype=self.dtype)
        model.mlp.to(device=self._device)
        self._model = model

    @torch.no_grad()
    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor:
        """Return the standardised ImageReward per (image, prompt), fp32 on CPU."""
        check_images(self.name, images, prompts)
        if self._model is None:
            raise RuntimeError(f"{self.name}: call setup(device) before score()")
        size = self._model.blip.visual_encoder.image_size
        pixels = clip_preprocess(
            images, size, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, device=self._device, dtype=self.dtype
        )  # ImageReward._transform: Resize(bicubic) + CenterCrop + ToTensor + Normalize (CLIP statistics)
        tokens = self._tokenizer(
            list(prompts), padding="max_length", truncation=True, max_length=MAX_PROMPT_TOKENS, return_tensors="pt"
        )
        rewards = self._model(pixels, tokens["input_ids"].to(self._device), tokens["attention_mask"].to(self._device))
        return check_scores(self.name, rewards)
