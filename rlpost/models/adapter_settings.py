"""Settings every diffusers-backed policy adapter shares: the weight-dtype policy (:func:`resolve_dtype`) and the LoRA
adapter spec (:class:`LoraSpec`; docs/models.md "Adding a model family").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

__all__ = ["SD3_LORA_TARGETS", "DTypeName", "LoraSpec", "peft_lora_names", "resolve_dtype"]

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
        r: peft's name for ``rank`` (``LoraConfig.r``); given, it sets ``rank``.
        lora_alpha: peft's name for ``alpha``; given, it sets ``alpha``.
        lora_dropout: peft's name for ``dropout``; given, it sets ``dropout``.
    """

    rank: int = 32
    alpha: int = 64
    init_lora_weights: Literal["gaussian"] | bool = "gaussian"
    target_modules: list[str] = field(default_factory=lambda: list(SD3_LORA_TARGETS))
    dropout: float = 0.0
    r: int | None = None
    lora_alpha: int | None = None
    lora_dropout: float | None = None

    PEFT_NAMES: ClassVar[dict[str, str]] = {"r": "rank", "lora_alpha": "alpha", "lora_dropout": "dropout"}
    """peft ``LoraConfig`` name -> rlpost's name; a recipe may use either (the run's recipe.yaml stores rlpost's)."""

    def __post_init__(self) -> None:
        """Move values given under peft's names to rlpost's."""
        for peft_name, name in self.PEFT_NAMES.items():
            value = getattr(self, peft_name)
            if value is not None:
                setattr(self, name, value)
                setattr(self, peft_name, None)

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


def peft_lora_names(model: Any) -> tuple[Any, list[str]]:
    """The recipe's ``model`` section with its LoRA settings (``init_args.lora``, or ``lora`` in the shorthand form)
    given under peft's names (``r``, ``lora_alpha``, ``lora_dropout``) renamed to rlpost's (``rank``, ``alpha``,
    ``dropout``), and the problems: a setting given under both names with different values.

    A command line's ``--model.init_args.lora.r 8`` reaches validation with every default filled in (``rank: 32``
    beside ``r: 8``): the peft name, given (not null), wins.
    """
    if not isinstance(model, dict):
        return model, []
    problems: list[str] = []
    out = dict(model)
    for where, holder in (("model.init_args.lora", out.get("init_args")), ("model.lora", out)):
        if not isinstance(holder, dict) or not isinstance(holder.get("lora"), dict):
            continue
        lora = dict(holder["lora"])
        for peft_name, name in LoraSpec.PEFT_NAMES.items():
            if peft_name not in lora:
                continue
            value = lora.pop(peft_name)
            if value is None:
                continue
            given = lora.get(name)
            default = getattr(LoraSpec, name)
            if given is not None and given != value and given != default:
                problems.append(f"{where}: {name}={given!r} and peft's {peft_name}={value!r} disagree; give one")
            lora[name] = value
        if holder is out:
            out["lora"] = lora
        else:
            out["init_args"] = {**holder, "lora": lora}
    return out, problems


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
