"""ImageReward v1.0 (Xu et al. 2023, arXiv:2304.05977; ``THUDM/ImageReward``) on transformers' BLIP modules, loading
the released ``ImageReward.pt`` + ``med_config.json`` without the ``image-reward`` package.

Why not the package: ``image-reward`` 1.5 (PyPI) requires ``timm==0.6.13`` and ``fairscale==0.4.13`` (our pinned set
has ``timm==1.0.31``, see ``constraints/cpu.txt``); its ``ImageReward/models/BLIP/med.py`` imports
``apply_chunking_to_forward``, ``find_pruneable_heads_and_indices`` and ``prune_linear_layer`` from
``transformers.modeling_utils``, which transformers 5 no longer has; its package ``__init__`` imports OpenAI
``clip``, which is not on PyPI; and ``BLIP_Pretrain`` fetches ``bert-base-uncased`` from the hub.

What ``ImageReward.score`` computes (``THUDM/ImageReward ImageReward/ImageReward.py@c1392c6``):

* ``blip.visual_encoder``: BLIP's ViT (``ImageReward/models/BLIP/vit.py``): timm-style pre-norm blocks, LayerNorm eps
  1e-6, packed qkv with bias, cls token, final norm; ViT-L/16 at 224 px in the release (``blip.py`` ``create_vit``:
  heads = width / 64). Here: transformers ``BlipVisionModel``, the same architecture under other parameter names.
* ``blip.text_encoder``: BLIP's "med" BERT (``models/BLIP/med.py``, ``mode="multimodal"``): word + absolute position
  embeddings, post-norm layers of self-attention, cross-attention to every image token, GELU MLP. Here:
  transformers ``BlipTextModel`` (``is_decoder=True`` so every layer has its cross-attention; called as an encoder,
  i.e. with a bidirectional mask), whose parameter names equal med's.
* ``mlp``: the 768→1024→128→64→16→1 linear head, on the text encoder's ``[CLS]`` state, then
  ``(r - 0.16717362830052426) / 1.0333394966054072``.

The checkpoint is the ``state_dict`` of the upstream ``ImageReward`` module. :func:`upstream_to_port_key` maps each
of its names to ours (the vision renames are those of transformers' BLIP conversion script,
``huggingface/transformers src/transformers/models/blip/convert_blip_original_pytorch_to_hf.py@0985bdd``
``rename_key``); the three entries ``score`` never reads (``blip.vision_proj``, ``blip.text_proj``, the
``position_ids`` buffer) are dropped by name, any other unknown name is an error, and the renamed dict is loaded with
``strict=True``. ``tests/plugins/rewards/test_imagereward.py`` checks this against a restatement of upstream's
forward that shares no code with this module.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from rlpost import HubFiles, RewardSource

from ._common import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, DTypeName, check_images, check_scores, clip_preprocess, to_dtype
from ._paths import HubSource, PathSpec, hub_files_of, path_problems, resolve_specs

__all__ = [
    "UNUSED_UPSTREAM_KEYS",
    "ImageRewardModel",
    "ImageRewardReward",
    "configs_from_checkpoint",
    "imagereward_from_state_dict",
    "load_blip_tokenizer",
    "load_imagereward",
    "upstream_to_port_key",
]

DEFAULT_CHECKPOINT = "ImageReward/ImageReward.pt"
DEFAULT_MED_CONFIG = "ImageReward/med_config.json"
DEFAULT_TOKENIZER_DIR = "bert-base-uncased"
OBTAIN = "https://huggingface.co/THUDM/ImageReward (files ImageReward.pt and med_config.json)"
OBTAIN_TOKENIZER = "https://huggingface.co/google-bert/bert-base-uncased (vocab.txt, tokenizer_config.json)"
_HUB_FILES = HubFiles("THUDM/ImageReward", ("ImageReward.pt", "med_config.json"), purpose="ImageReward checkpoint")
HUB_CHECKPOINT = HubSource(_HUB_FILES, "ImageReward.pt")
HUB_MED_CONFIG = HubSource(_HUB_FILES, "med_config.json")
HUB_TOKENIZER = HubSource(
    HubFiles("google-bert/bert-base-uncased", ("vocab.txt", "tokenizer_config.json"), purpose="BERT tokenizer")
)

# ImageReward.py (ImageReward.__init__): reward standardisation constants of the released model.
REWARD_MEAN = 0.16717362830052426
REWARD_STD = 1.0333394966054072
MAX_PROMPT_TOKENS = 35
VIT_LAYER_NORM_EPS = 1e-6  # vit.py: norm_layer = partial(nn.LayerNorm, eps=1e-6)

# Upstream name -> our name (full match). Vision: BLIP vit.py names -> BlipVisionModel names. Text: med.py's BERT
# names are BlipTextModel's. Head: ImageReward.MLP -> AestheticMLP (same nn.Sequential layout).
_RENAMES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), replacement)
    for pattern, replacement in (
        (r"blip\.visual_encoder\.cls_token", "vision.embeddings.class_embedding"),
        (r"blip\.visual_encoder\.pos_embed", "vision.embeddings.position_embedding"),
        (r"blip\.visual_encoder\.patch_embed\.proj\.(weight|bias)", r"vision.embeddings.patch_embedding.\1"),
        (
            r"blip\.visual_encoder\.blocks\.(\d+)\.norm([12])\.(weight|bias)",
            r"vision.encoder.layers.\1.layer_norm\2.\3",
        ),
        (
            r"blip\.visual_encoder\.blocks\.(\d+)\.attn\.qkv\.(weight|bias)",
            r"vision.encoder.layers.\1.self_attn.qkv.\2",
        ),
        (
            r"blip\.visual_encoder\.blocks\.(\d+)\.attn\.proj\.(weight|bias)",
            r"vision.encoder.layers.\1.self_attn.projection.\2",
        ),
        (r"blip\.visual_encoder\.blocks\.(\d+)\.mlp\.(fc[12])\.(weight|bias)", r"vision.encoder.layers.\1.mlp.\2.\3"),
        (r"blip\.visual_encoder\.norm\.(weight|bias)", r"vision.post_layernorm.\1"),
        (
            r"blip\.text_encoder\.(embeddings\.(?:(?:word|position)_embeddings\.weight|LayerNorm\.(?:weight|bias)))",
            r"text.\1",
        ),
        (
            r"blip\.text_encoder\.(encoder\.layer\.\d+\.(?:(?:attention|crossattention)\.(?:self\.(?:query|key|value)"
            r"|output\.(?:dense|LayerNorm))|intermediate\.dense|output\.(?:dense|LayerNorm))\.(?:weight|bias))",
            r"text.\1",
        ),
        (r"mlp\.layers\.([02467])\.(weight|bias)", r"head.layers.\1.\2"),  # Linear slots of the Sequential
    )
)

UNUSED_UPSTREAM_KEYS: frozenset[str] = frozenset(
    {
        # BLIP_Pretrain's contrastive projections: ImageReward.score never applies them.
        "blip.vision_proj.weight",
        "blip.vision_proj.bias",
        "blip.text_proj.weight",
        "blip.text_proj.bias",
        # med.py BertEmbeddings' persistent arange buffer; BlipTextEmbeddings rebuilds it (non-persistent).
        "blip.text_encoder.embeddings.position_ids",
    }
)
"""Names in ``ImageReward.pt`` that ``ImageReward.score`` does not read; dropped on load."""


def upstream_to_port_key(key: str) -> str | None:
    """Our parameter name for an ``ImageReward.pt`` key, ``None`` for :data:`UNUSED_UPSTREAM_KEYS`.

    Raises:
        KeyError: For a name the upstream ``ImageReward`` module does not have.
    """
    if key in UNUSED_UPSTREAM_KEYS:
        return None
    for pattern, replacement in _RENAMES:
        if pattern.fullmatch(key):
            return pattern.sub(replacement, key)
    raise KeyError(key)


class ImageRewardModel(nn.Module):
    """BLIP vision tower + multimodal BERT + MLP head computing ``ImageReward.score``.

    Args:
        vision_config: transformers ``BlipVisionConfig`` of the ViT.
        text_config: transformers ``BlipTextConfig`` of the med BERT (``encoder_hidden_size`` = ViT width).
    """

    def __init__(self, vision_config: Any, text_config: Any) -> None:
        super().__init__()
        from transformers import BlipTextModel, BlipVisionModel

        from .aesthetic import AestheticMLP  # same head layout as ImageReward.MLP

        if not text_config.is_decoder:
            raise ValueError("text_config.is_decoder must be True: it is what gives BlipTextModel its cross-attention")
        self.image_size = int(vision_config.image_size)
        self.vision_width = int(vision_config.hidden_size)
        self.vision: nn.Module = BlipVisionModel(vision_config)
        self.text: nn.Module = BlipTextModel(text_config, add_pooling_layer=False)
        self.head = AestheticMLP(int(text_config.hidden_size))
        self.max_positions = int(text_config.max_position_embeddings)

    def forward(self, pixels: Tensor, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Standardised reward ``[B]`` from normalised ``pixels`` and the tokenised prompt."""
        image_states = self.vision(pixel_values=pixels).last_hidden_state
        # Upstream passes an all-ones encoder mask (every image token attended); no mask is the same.
        text_states = self.text(
            input_ids=input_ids, attention_mask=attention_mask, encoder_hidden_states=image_states
        ).last_hidden_state
        raw: Tensor = self.head(text_states[:, 0, :].float()).squeeze(1)
        return (raw - REWARD_MEAN) / REWARD_STD


def configs_from_checkpoint(
    state: dict[str, Tensor], med: dict[str, Any], source: object = "checkpoint"
) -> tuple[Any, Any]:
    """``BlipVisionConfig`` sized from the checkpoint's ViT tensors and ``BlipTextConfig`` from ``med_config.json``.

    Args:
        state: The upstream-named state dict (tensors may be on the meta device; only shapes are read).
        med: ``med_config.json`` contents.
        source: Where ``state`` came from (for error messages).
    """
    from transformers import BlipTextConfig, BlipVisionConfig

    try:
        patch = state["blip.visual_encoder.patch_embed.proj.weight"]
        pos = state["blip.visual_encoder.pos_embed"]
        mlp_hidden = int(state["blip.visual_encoder.blocks.0.mlp.fc1.weight"].shape[0])
    except KeyError as err:
        raise ValueError(f"{source}: not an ImageReward checkpoint (missing {err})") from err
    width, patch_size = int(patch.shape[0]), int(patch.shape[-1])
    depth = len({k.split(".")[3] for k in state if k.startswith("blip.visual_encoder.blocks.")})
    vision = BlipVisionConfig(
        hidden_size=width,
        intermediate_size=mlp_hidden,
        num_hidden_layers=depth,
        num_attention_heads=max(1, width // 64),  # blip.py create_vit: 12 heads at 768, 16 at 1024
        image_size=int(round(math.sqrt(pos.shape[1] - 1))) * patch_size,
        patch_size=patch_size,
        hidden_act="gelu",  # vit.py Mlp: nn.GELU (exact)
        layer_norm_eps=VIT_LAYER_NORM_EPS,
        attention_dropout=0.0,
    )
    kind = med.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(f"med_config.json: position_embedding_type {kind!r} is not supported (ImageReward: absolute)")
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads") if k not in med]
    if missing:
        raise ValueError(f"med_config.json: missing field(s) {missing}")
    text = BlipTextConfig(
        vocab_size=int(med["vocab_size"]),
        hidden_size=int(med["hidden_size"]),
        encoder_hidden_size=width,  # blip_pretrain.py: encoder_config.encoder_width = vision_width
        intermediate_size=int(med.get("intermediate_size", 4 * int(med["hidden_size"]))),
        num_hidden_layers=int(med["num_hidden_layers"]),
        num_attention_heads=int(med["num_attention_heads"]),
        max_position_embeddings=int(med.get("max_position_embeddings", 512)),
        hidden_act=str(med.get("hidden_act", "gelu")),
        layer_norm_eps=float(med.get("layer_norm_eps", 1e-12)),
        pad_token_id=int(med.get("pad_token_id", 0)),
        bos_token_id=None,  # generation-only ids; BlipTextConfig's defaults assume BERT's 30524-token vocabulary
        eos_token_id=None,
        sep_token_id=None,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        is_decoder=True,  # builds the cross-attention of every layer; forward still runs bidirectionally
    )
    return vision, text


def imagereward_from_state_dict(
    state: dict[str, Tensor], med: dict[str, Any], source: object = "checkpoint"
) -> ImageRewardModel:
    """Rename an upstream ``ImageReward`` state dict and load it strictly into a new :class:`ImageRewardModel`.

    The model is built on the meta device and takes the checkpoint's tensors (``assign=True``), so no random
    initialisation runs and no second copy of the weights is made; the parameters are then cast to fp32.
    A leading ``module.`` (a DistributedDataParallel save) is stripped.

    Raises:
        ValueError: On a key the upstream module does not have, a missing parameter or a shape mismatch.
    """
    state = {k.removeprefix("module."): v for k, v in state.items()}
    vision_cfg, text_cfg = configs_from_checkpoint(state, med, source)
    renamed: dict[str, Tensor] = {}
    unknown: list[str] = []
    for key, value in state.items():
        try:
            ours = upstream_to_port_key(key)
        except KeyError:
            unknown.append(key)
            continue
        if ours is not None:
            renamed[ours] = value
    if unknown:
        raise ValueError(f"{source}: keys an ImageReward checkpoint does not have: {sorted(unknown)[:8]}")
    with torch.device("meta"):
        model = ImageRewardModel(vision_cfg, text_cfg)
    own = model.state_dict()
    missing = sorted(set(own) - set(renamed))
    if missing:
        raise ValueError(f"{source}: missing parameters {missing[:8]} (checkpoint/med_config mismatch?)")
    wrong = [k for k in own if tuple(renamed[k].shape) != tuple(own[k].shape)]
    if wrong:
        raise ValueError(f"{source}: shape mismatch for {wrong[:8]} (does med_config.json match?)")
    model.load_state_dict(renamed, strict=True, assign=True)
    # The one non-persistent buffer (not in any checkpoint) is still on the meta device.
    embeddings: Any = model.text.embeddings
    embeddings.register_buffer("position_ids", torch.arange(model.max_positions).expand((1, -1)), persistent=False)
    return model.float().eval().requires_grad_(False)


def load_imagereward(
    checkpoint: str | os.PathLike[str], med_config: str | os.PathLike[str]
) -> tuple[ImageRewardModel, dict[str, Any]]:
    """Read ``ImageReward.pt`` (``torch.load(weights_only=True)``, or safetensors) and ``med_config.json`` and build
    the model with :func:`imagereward_from_state_dict`.

    Returns:
        The model (eval mode, fp32, on CPU) and the med config with ``encoder_width`` set to the ViT width.
    """
    from ._common import load_state_dict_file

    state = load_state_dict_file(checkpoint)
    med: dict[str, Any] = json.loads(Path(med_config).read_text())
    model = imagereward_from_state_dict(state, med, checkpoint)
    return model, dict(med, encoder_width=model.vision_width)


def load_blip_tokenizer(tokenizer_dir: str | os.PathLike[str], expected_vocab: int) -> Any:
    """``bert-base-uncased`` tokenizer from a local directory plus BLIP's ``[DEC]`` and ``[ENC]`` tokens
    (``blip.py`` ``init_tokenizer``), checked against the text tower's vocabulary size (30524 for the release)."""
    from transformers import BertTokenizer

    tokenizer = BertTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_tokens(["[ENC]"], special_tokens=True)
    # A wrong or incomplete tokenizer directory (e.g. BERT's 5 special tokens only) maps every word to [UNK].
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
        return path_problems(self, recipe, self._specs())

    def _specs(self) -> list[PathSpec]:
        return [
            PathSpec("checkpoint", self.checkpoint, DEFAULT_CHECKPOINT, "checkpoint", OBTAIN, hub=HUB_CHECKPOINT),
            PathSpec("med_config", self.med_config, DEFAULT_MED_CONFIG, "med config", OBTAIN, hub=HUB_MED_CONFIG),
            PathSpec(
                "tokenizer_dir",
                self.tokenizer_dir,
                DEFAULT_TOKENIZER_DIR,
                "BERT tokenizer",
                OBTAIN_TOKENIZER,
                True,
                HUB_TOKENIZER,
            ),
        ]

    def hub_files(self) -> list[HubFiles]:
        """The checkpoint with its config and the BERT tokenizer, unless given by path."""
        return hub_files_of(self._specs())

    def setup(self, device: torch.device) -> None:
        """Load the checkpoint and tokenizer from local files onto ``device`` (once)."""
        if self._model is not None:
            return
        paths = resolve_specs(self.name, self._specs())
        ckpt, med, tok = paths["checkpoint"], paths["med_config"], paths["tokenizer_dir"]
        model, cfg = load_imagereward(ckpt, med)
        self._tokenizer = load_blip_tokenizer(tok, int(cfg["vocab_size"]))
        self._device = torch.device(device)
        model.vision.to(device=self._device, dtype=self.dtype)
        model.text.to(device=self._device, dtype=self.dtype)
        model.head.to(device=self._device)  # the head stays fp32, as upstream's ``.float()`` before ``mlp``
        self._model = model

    @torch.no_grad()
    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor:
        """Return the standardised ImageReward per (image, prompt), fp32 on CPU."""
        check_images(self.name, images, prompts)
        if self._model is None:
            raise RuntimeError(f"{self.name}: call setup(device) before score()")
        size = self._model.image_size
        pixels = clip_preprocess(
            images, size, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, device=self._device, dtype=self.dtype
        )  # ImageReward._transform: Resize(bicubic) + CenterCrop + ToTensor + Normalize (CLIP statistics)
        tokens = self._tokenizer(
            list(prompts), padding="max_length", truncation=True, max_length=MAX_PROMPT_TOKENS, return_tensors="pt"
        )
        rewards = self._model(pixels, tokens["input_ids"].to(self._device), tokens["attention_mask"].to(self._device))
        return check_scores(self.name, rewards)
