"""A policy's trainable weights as a checkpoint holds them, and their diffusers-loadable form.

* :func:`trainable_weights` / :func:`load_trainable`: the trainable parameters keyed by position, restored bitwise
  (what ``weights.safetensors`` in a checkpoint holds; the backends' ``full_state_dict`` use them).
* :func:`write_diffusers_artifacts`: ``lora/pytorch_lora_weights.safetensors`` for policies with a LoRA adapter
  (through the policy's ``save_lora``), or ``transformer/`` (``save_pretrained``) for a fully fine-tuned transformer.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from rlpost.core.api import Policy
from rlpost.engine.checkpoint import CheckpointError

__all__ = ["LORA_DIR", "TRANSFORMER_DIR", "load_trainable", "trainable_weights", "write_diffusers_artifacts"]

LORA_DIR = "lora"
TRANSFORMER_DIR = "transformer"


def trainable_weights(parameters: Sequence[nn.Parameter]) -> dict[str, Tensor]:
    """Trainable parameters keyed by position (``trainable.0000`` ...): works for every policy, restored bitwise."""
    return {f"trainable.{i:04d}": p.detach() for i, p in enumerate(parameters)}


@torch.no_grad()
def load_trainable(parameters: Sequence[nn.Parameter], weights: dict[str, Tensor]) -> None:
    """Copy checkpointed weights into ``parameters`` (same order as ``Policy.trainable_parameters()``).

    Raises:
        CheckpointError: The count or a shape differs (the recipe's model or LoRA settings changed).
    """
    if len(weights) != len(parameters):
        raise CheckpointError(
            f"the checkpoint holds {len(weights)} trainable tensors but the policy has {len(parameters)} trainable "
            "parameters (did the model, LoRA rank/targets or full_finetune change?)"
        )
    for i, p in enumerate(parameters):
        t = weights.get(f"trainable.{i:04d}")
        if t is None or t.shape != p.shape:
            got = None if t is None else tuple(t.shape)
            raise CheckpointError(f"trainable parameter {i}: checkpoint shape {got} != policy shape {tuple(p.shape)}")
        p.copy_(t.to(p.device, p.dtype))


def write_diffusers_artifacts(policy: Policy, directory: Path) -> list[str]:
    """Write the diffusers-loadable form of ``policy``'s trainable weights into ``directory``; returns what."""
    written: list[str] = []
    save_lora = getattr(policy, "save_lora", None)
    if callable(save_lora) and getattr(policy, "lora", None) is not None:
        save_lora(directory / LORA_DIR)
        written.append(LORA_DIR)
    elif getattr(policy, "full_finetune", False) and hasattr(getattr(policy, "transformer", None), "save_pretrained"):
        policy.transformer.save_pretrained(str(directory / TRANSFORMER_DIR), safe_serialization=True)  # type: ignore[attr-defined]
        written.append(TRANSFORMER_DIR)
    return written
