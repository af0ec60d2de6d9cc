"""Shared open_clip plumbing for HPS-v2.1 and CLIPScore: build a model offline, tokenise, and compute the
per-image cosine between normalised image and prompt features."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ._common import clip_preprocess

__all__ = ["OpenClipScorer"]


class OpenClipScorer:
    """An open_clip model, its tokenizer and preprocessing config, ready to score ``(image, prompt)`` pairs.

    Args:
        model: An open_clip ``CLIP`` / ``CustomTextCLIP`` in eval mode on its device.
        tokenizer: The matching open_clip tokenizer (callable on a list of strings).
        device: Device of ``model``.
        dtype: Compute dtype of the towers (features are compared in fp32).
        resize_mode: Override of the model's preprocessing ``resize_mode`` (see :func:`clip_preprocess`).
        float_resize: Resize ``[0, 1]`` floats rather than uint8 (see :func:`clip_preprocess`).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        device: torch.device,
        dtype: torch.dtype,
        resize_mode: str | None = None,
        float_resize: bool = False,
    ) -> None:
        import open_clip

        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.dtype = dtype
        cfg = open_clip.get_model_preprocess_cfg(model)
        self.size = cfg.get("size", 224)
        self.mean = cfg.get("mean", (0.48145466, 0.4578275, 0.40821073))
        self.std = cfg.get("std", (0.26862954, 0.26130258, 0.27577711))
        self.interpolation = cfg.get("interpolation", "bicubic")
        self.resize_mode = resize_mode or cfg.get("resize_mode", "shortest")
        self.float_resize = float_resize

    @classmethod
    def build(
        cls,
        reward: str,
        model_name: str,
        device: torch.device,
        dtype: torch.dtype,
        state_dict: dict[str, Tensor] | None = None,
        pretrained: str | None = None,
        resize_mode: str | None = None,
        float_resize: bool = False,
    ) -> OpenClipScorer:
        """Create ``model_name`` with no pretrained download, then load weights from a local source.

        Args:
            reward: Recipe name of the reward (for error messages).
            model_name: open_clip model config name (e.g. ``"ViT-H-14"``).
            device: Target device.
            dtype: Compute dtype.
            state_dict: Full model state dict to load strictly (HPS checkpoints).
            pretrained: Local weights file handed to open_clip (it loads with ``weights_only=True``).
            resize_mode: Preprocessing override (HPS: ``"longest"``); default: open_clip's config for the model.
            float_resize: Resize ``[0, 1]`` floats rather than uint8.
        """
        import open_clip

        if model_name not in open_clip.list_models():
            raise ValueError(f"{reward}: unknown open_clip model {model_name!r}; see open_clip.list_models()")
        model = open_clip.create_model(model_name, pretrained=pretrained, device="cpu")
        if state_dict is not None:
            state_dict = {k.removeprefix("module."): v for k, v in state_dict.items()}
            missing, unexpected = model.load_state_dict(state_dict, strict=False)
            if missing or unexpected:
                raise ValueError(
                    f"{reward}: checkpoint does not match open_clip {model_name!r}: "
                    f"missing {sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}"
                )
        model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        tokenizer = open_clip.get_tokenizer(model_name)
        # A broken tokenizer (e.g. a failed download) maps words to a tiny vocabulary: check it fits the text tower.
        tok_vocab = getattr(tokenizer, "vocab_size", None)
        model_vocab = getattr(model, "vocab_size", None)
        if tok_vocab is not None and model_vocab is not None and int(tok_vocab) > int(model_vocab):
            raise ValueError(f"{reward}: tokenizer vocabulary {tok_vocab} exceeds the model's {model_vocab}")
        if tok_vocab is not None and int(tok_vocab) < 1000:
            raise ValueError(f"{reward}: tokenizer vocabulary has only {tok_vocab} tokens (a failed hub lookup?)")
        return cls(model, tokenizer, device, dtype, resize_mode, float_resize)

    @torch.no_grad()
    def cosine(self, images: Tensor, prompts: Sequence[str]) -> Tensor:
        """``diag(f_img · f_txtᵀ)`` for L2-normalised features: one cosine per (image, prompt) pair, fp32.

        HPSv2 ``img_score.py``: ``torch.diagonal(image_features @ text_features.T)``; computing the row-wise dot
        product instead avoids the ``S x S`` matrix and gives the same diagonal.
        """
        pixels = clip_preprocess(
            images,
            self.size,
            self.mean,
            self.std,
            interpolation=self.interpolation,
            resize_mode=self.resize_mode,
            float_resize=self.float_resize,
            device=self.device,
            dtype=self.dtype,
        )
        tokens = self.tokenizer(list(prompts)).to(self.device)
        model: Any = self.model
        img = model.encode_image(pixels).float()
        txt = model.encode_text(tokens).float()
        img = img / img.norm(dim=-1, keepdim=True)
        txt = txt / txt.norm(dim=-1, keepdim=True)
        out: Tensor = (img * txt).sum(dim=-1)
        return out
