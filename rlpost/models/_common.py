"""Model-agnostic helpers for diffusers-backed policy adapters (SD3, FLUX.1; docs/models.md "Adding a model family").

Kept as functions and small classes (composition, not a base class) so a new adapter reuses them without inheriting
behaviour it cannot see: model-directory checks with clear errors, the dtype policy, the LoRA spec, and a per-prompt
encoding cache.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "SD3_LORA_TARGETS",
    "DTypeName",
    "LoraSpec",
    "ModelDirError",
    "PromptCache",
    "cached_snapshot",
    "check_pipeline_dir",
    "is_local_path",
    "resolution_problems",
    "resolve_dtype",
]

DTypeName = Literal["auto", "float32", "bfloat16", "float16"]

SD3_LORA_TARGETS: tuple[str, ...] = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
)
"""The SD3 joint-attention projections Flow-GRPO/diffusers' SD3 LoRA scripts adapt (image and text streams)."""


class ModelDirError(FileNotFoundError):
    """A model directory is missing or is not a loadable diffusers pipeline; the message names what is missing."""


@dataclass
class LoraSpec:
    """LoRA adapter settings (peft ``LoraConfig``) for the denoiser.

    Attributes:
        rank: Adapter rank ``r`` (Flow-GRPO SD3.5: 32).
        alpha: Scaling numerator ``lora_alpha``; the update is scaled by ``alpha / rank`` (Flow-GRPO: 64).
        init_lora_weights: peft initialisation: ``"gaussian"`` (Flow-GRPO) or ``True`` (Kaiming A); B starts at zero
            either way, so a fresh adapter leaves the model unchanged.
        target_modules: Module-name suffixes to adapt; defaults to SD3's attention projections.
        dropout: LoRA dropout. Keep 0: dropout makes recomputed log-probs differ from the rollout's.
    """

    rank: int = 32
    alpha: int = 64
    init_lora_weights: Literal["gaussian"] | bool = "gaussian"
    target_modules: list[str] = field(default_factory=lambda: list(SD3_LORA_TARGETS))
    dropout: float = 0.0

    def problems(self, prefix: str) -> list[str]:
        """Range problems of these settings, each naming its field under ``prefix`` (e.g. ``model.init_args.lora``)."""
        problems = []
        if self.rank < 1:
            problems.append(f"{prefix}.rank: must be >= 1, got {self.rank}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            problems.append(f"{prefix}.alpha: must be positive, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"{prefix}.dropout: must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            problems.append(f"{prefix}.target_modules: must name at least one module")
        return problems

    def to_peft(self) -> object:
        """The equivalent ``peft.LoraConfig``."""
        from peft import LoraConfig

        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            init_lora_weights=self.init_lora_weights,
            target_modules=list(self.target_modules),
            lora_dropout=self.dropout,
        )


def resolve_dtype(name: DTypeName, device: torch.device) -> torch.dtype:
    """Weight dtype: ``"auto"`` is bf16 on CUDA and fp32 elsewhere (CPU bf16 matmuls are slow and imprecise).

    Kernel means and log-probs are always computed in fp32 regardless (see :mod:`rlpost.ops.kernels`).
    """
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; choose auto, float32, bfloat16 or float16")
    return table[name]


def is_local_path(name: str) -> bool:
    """Whether ``name`` denotes a local directory rather than a hub id (``owner/name``).

    A name that exists on disk is local; so is anything path-shaped (absolute, ``./``, ``../``, ``~``, or not
    exactly one ``/``), which lets a mistyped local path fail with "directory does not exist" instead of a hub error.
    """
    if Path(name).expanduser().exists():
        return True
    return name.startswith(("/", "./", "../", "~", ".\\")) or name.count("/") != 1


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")


def check_pipeline_dir(path: Path, required: Iterable[str], weighted: Iterable[str]) -> None:
    """Check a local diffusers pipeline directory before handing it to ``from_pretrained``.

    Args:
        path: The pipeline directory.
        required: Component names that must be present in ``model_index.json`` and on disk.
        weighted: Components (among those present) that must hold a ``config.json`` and weights.

    Raises:
        ModelDirError: Naming the first missing piece (directory, ``model_index.json``, a component entry, a
            component subfolder, its config or its weights).
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelDirError(f"model directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise ModelDirError(f"model path {str(path)!r} is a file, expected a diffusers pipeline directory")
    index_file = path / "model_index.json"
    if not index_file.is_file():
        raise ModelDirError(
            f"{str(path)!r} is not a diffusers pipeline directory: missing model_index.json "
            "(save a pipeline with save_pretrained or download the full repository)"
        )
    try:
        index = json.loads(index_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelDirError(f"{str(index_file)!r} is not valid JSON: {e}") from e
    if not isinstance(index, dict):
        raise ModelDirError(f"{str(index_file)!r} is malformed: expected a JSON object")
    present = {k for k, v in index.items() if isinstance(v, list) and len(v) == 2 and v[0] is not None}
    for comp in required:
        if comp not in present:
            raise ModelDirError(f"{str(index_file)!r} does not declare the required component {comp!r}")
    weighted = set(weighted)
    for comp in sorted(present):
        sub = path / comp
        if not sub.is_dir():
            raise ModelDirError(
                f"model directory {str(path)!r} is missing the {comp}/ subfolder (see model_index.json)"
            )
        if comp in weighted:
            if not (sub / "config.json").is_file():
                raise ModelDirError(f"{str(sub)!r} is missing config.json")
            if not any(f.name.endswith(_WEIGHT_SUFFIXES) for f in sub.iterdir()):
                raise ModelDirError(f"{str(sub)!r} holds no weights (*.safetensors or *.bin)")
        elif comp == "scheduler" and not (sub / "scheduler_config.json").is_file():
            raise ModelDirError(f"{str(sub)!r} is missing scheduler_config.json")


def cached_snapshot(repo_id: str) -> Path:
    """The local-cache snapshot directory of hub model ``repo_id`` (a file-system lookup; nothing is downloaded).

    Raises:
        ModelDirError: The model is not in the local Hugging Face cache.
    """
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as e:  # noqa: BLE001 - LocalEntryNotFoundError, or a malformed id (HFValidationError)
        raise ModelDirError(
            f"{repo_id!r} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and rlpost does not "
            f"download at training time ({type(e).__name__}); download it first (huggingface-cli download {repo_id}) "
            "or give a local pipeline directory"
        ) from None


def resolution_problems(path: Path, resolution: int) -> list[str]:
    """Why an image of ``resolution`` pixels does not fit the pipeline in ``path``, read from its ``vae`` and
    ``transformer`` ``config.json``: it must be a multiple of VAE factor x patch size, and its latent patches must fit
    the transformer's positional embedding (``pos_embed_max_size``). Missing or unreadable configs check nothing."""
    try:
        vae = json.loads((path / "vae" / "config.json").read_text(encoding="utf-8"))
        transformer = json.loads((path / "transformer" / "config.json").read_text(encoding="utf-8"))
        vae_factor = 2 ** (len(vae["block_out_channels"]) - 1)
        patch = int(transformer.get("patch_size", 1))
    except (OSError, ValueError, KeyError, TypeError):
        return []
    factor = vae_factor * patch
    if resolution % factor:
        return [f"{resolution} is not a multiple of {factor} (VAE factor {vae_factor} x patch size {patch})"]
    max_patches = transformer.get("pos_embed_max_size")
    if isinstance(max_patches, int) and resolution // factor > max_patches:
        return [
            f"{resolution} is too large for this model: at most {max_patches * factor} "
            f"(pos_embed_max_size {max_patches} patches x {factor} pixels)"
        ]
    return []


class PromptCache:
    """Per-prompt-string cache of encoder outputs: each prompt is encoded once per process.

    ``encode_new(prompts)`` is called with the prompts not yet cached (in first-seen order) and returns a dict of
    ``[len(prompts), ...]`` tensors; rows are stored per prompt and reassembled in request order.
    """

    def __init__(self) -> None:
        self._rows: dict[str, dict[str, Tensor]] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def clear(self) -> None:
        """Drop every cached encoding (e.g. after the text encoders change)."""
        self._rows.clear()

    def get(self, prompts: Sequence[str], encode_new: Callable[[list[str]], dict[str, Tensor]]) -> dict[str, Tensor]:
        """Return stacked encodings of ``prompts``, encoding the missing ones in one batch."""
        missing = list(dict.fromkeys(p for p in prompts if p not in self._rows))
        if missing:
            out = encode_new(missing)
            for i, p in enumerate(missing):
                self._rows[p] = {k: v[i : i + 1].detach() for k, v in out.items()}
        if not prompts:
            raise ValueError("encode() needs at least one prompt")
        keys = self._rows[prompts[0]].keys()
        return {k: torch.cat([self._rows[p][k] for p in prompts], dim=0) for k in keys}
