"""PickScore (Kirstain et al. 2023, ``yuvalkirstain/PickScore_v1``): a CLIP-H fine-tuned on Pick-a-Pic preferences.

Official scoring: ``logit_scale.exp() * cos(text_emb, image_emb)`` with L2-normalised projected embeddings, processor
``laion/CLIP-ViT-H-14-laion2B-s32B-b79K`` (``yuvalkirstain/PickScore README.md@f79607f``). Typical values ≈ 18-23.
Flow-GRPO divides that by 26 (``yifan123/flow_grpo flow_grpo/pickscore_scorer.py@ac4c86e``;
``convention="flow-grpo"``); ``convention="cosine"`` returns the raw cosine.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from rlpost import HubFiles, InvalidArguments, RewardSource

from ._common import DTypeName, check_images, check_scores, to_dtype
from ._hfclip import HFClip
from ._paths import HubSource, PathSpec, hub_files_of, path_problems, resolve_specs

__all__ = ["PickScoreReward"]

DEFAULT_MODEL_DIR = "PickScore_v1"
DEFAULT_TOKENIZER_DIR = "CLIP-ViT-H-14-laion2B-s32B-b79K"
OBTAIN_MODEL = "https://huggingface.co/yuvalkirstain/PickScore_v1 (repository snapshot, transformers CLIPModel)"
OBTAIN_TOKENIZER = (
    "https://huggingface.co/laion/CLIP-ViT-H-14-laion2B-s32B-b79K (tokenizer.json or vocab.json + merges.txt, "
    "tokenizer_config.json, special_tokens_map.json, preprocessor_config.json)"
)
HUB_MODEL = HubSource(HubFiles("yuvalkirstain/PickScore_v1", purpose="PickScore model"))
HUB_TOKENIZER = HubSource(
    HubFiles("laion/CLIP-ViT-H-14-laion2B-s32B-b79K", ("*.json", "*.txt"), purpose="CLIP-H tokenizer")
)


class PickScoreReward(RewardSource):
    """PickScore of each (image, prompt) pair.

    Args:
        model_dir: Local ``PickScore_v1`` directory (transformers ``CLIPModel``); default
            ``$RLPOST_MODELS/PickScore_v1``.
        tokenizer_dir: Local directory with the CLIP tokenizer (and ``preprocessor_config.json``) of
            ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``; default ``$RLPOST_MODELS/CLIP-ViT-H-14-laion2B-s32B-b79K``.
        convention: ``"logit"``: ``logit_scale.exp()·cos`` (the PickScore paper, ≈ 18-23); ``"cosine"``: raw cosine;
            ``"flow-grpo"``: ``logit_scale.exp()·cos / 26`` (Flow-GRPO's scaling).
        dtype: Compute dtype of the CLIP towers (scores are returned in fp32).
    """

    name: ClassVar[str] = "pickscore"

    def __init__(
        self,
        model_dir: str | None = None,
        tokenizer_dir: str | None = None,
        convention: Literal["logit", "cosine", "flow-grpo"] = "logit",
        dtype: DTypeName = "float32",
    ) -> None:
        if convention not in ("logit", "cosine", "flow-grpo"):
            allowed = "must be 'logit', 'cosine' or 'flow-grpo'"
            raise InvalidArguments(type(self).__name__, {"convention": f"{allowed}, got {convention!r}"})
        self.model_dir = model_dir
        self.tokenizer_dir = tokenizer_dir
        self.convention = convention
        self.dtype = to_dtype(dtype)
        self._clip: HFClip | None = None
        self._tokenizer: Any = None
        self._logit_scale = 1.0

    def validate(self, recipe: Any) -> list[str]:
        """The model and tokenizer directories must be installed (directory checks; nothing loads)."""
        return path_problems(self, recipe, self._specs())

    def _specs(self) -> list[PathSpec]:
        return [
            PathSpec("model_dir", self.model_dir, DEFAULT_MODEL_DIR, "PickScore model", OBTAIN_MODEL, True, HUB_MODEL),
            PathSpec(
                "tokenizer_dir",
                self.tokenizer_dir,
                DEFAULT_TOKENIZER_DIR,
                "CLIP-H tokenizer",
                OBTAIN_TOKENIZER,
                True,
                HUB_TOKENIZER,
            ),
        ]

    def hub_files(self) -> list[HubFiles]:
        """The PickScore model and the CLIP-H tokenizer, unless given by path."""
        return hub_files_of(self._specs())

    def setup(self, device: torch.device) -> None:
        """Load the model and tokenizer from local directories onto ``device`` (once)."""
        if self._clip is not None:
            return
        from transformers import AutoTokenizer

        paths = resolve_specs(self.name, self._specs())
        model_path, tok_path = paths["model_dir"], paths["tokenizer_dir"]
        tokenizer = AutoTokenizer.from_pretrained(str(tok_path), local_files_only=True)
        clip = HFClip.load(self.name, model_path, torch.device(device), self.dtype)
        if (tok_path / "preprocessor_config.json").is_file() and not (
            model_path / "preprocessor_config.json"
        ).is_file():
            clip = HFClip.load_preprocessing_from(clip, tok_path)
        model: Any = clip.model
        # A broken tokenizer (e.g. a failed download) has a tiny vocabulary that maps words to UNK.
        vocab = int(model.config.text_config.vocab_size)
        if len(tokenizer) != vocab:
            raise ValueError(
                f"{self.name}: tokenizer in {tok_path} has {len(tokenizer)} tokens but the text tower expects {vocab}"
            )
        self._logit_scale = float(model.logit_scale.exp().item())
        self._clip, self._tokenizer = clip, tokenizer

    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor:
        """Return the PickScore (in the configured convention) per (image, prompt), fp32 on CPU."""
        check_images(self.name, images, prompts)
        if self._clip is None:
            raise RuntimeError(f"{self.name}: call setup(device) before score()")
        tokens = self._tokenizer(list(prompts), padding=True, truncation=True, max_length=77, return_tensors="pt")
        img = self._clip.image_embeds(images)
        txt = self._clip.text_embeds(tokens["input_ids"], tokens["attention_mask"])
        cos = (img * txt).sum(dim=-1)
        if self.convention == "cosine":
            return check_scores(self.name, cos)
        scaled = self._logit_scale * cos
        return check_scores(self.name, scaled / 26.0 if self.convention == "flow-grpo" else scaled)
