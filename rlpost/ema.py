"""Exponential moving average of the trainable weights (optional; recipe section ``ema``).

When enabled, held-out evaluation and the diffusers-loadable artefacts of checkpoints/exports use the EMA weights
(swapped in with :meth:`EMA.swapped`); the live weights keep training and are what resume restores.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["EMA", "EMAConfig"]


@dataclass
class EMAConfig:
    """Recipe section ``ema``.

    Attributes:
        decay: ``shadow <- decay·shadow + (1-decay)·weights`` at every update.
        update_every: Update the shadow every N training steps.
    """

    decay: float = 0.999
    update_every: int = 1


class EMA:
    """fp32 shadow copies of ``parameters``.

    Args:
        parameters: The trainable parameters (same order as ``Policy.trainable_parameters()``).
        config: Decay and update interval.
    """

    def __init__(self, parameters: list[nn.Parameter], config: EMAConfig) -> None:
        self.parameters = parameters
        self.config = config
        self.shadow = [p.detach().float().clone() for p in parameters]

    @torch.no_grad()
    def update(self, step: int) -> bool:
        """Update the shadow after completed training step ``step`` when due; returns whether it updated."""
        if step % self.config.update_every:
            return False
        d = self.config.decay
        for s, p in zip(self.shadow, self.parameters, strict=True):
            s.mul_(d).add_(p.detach().float(), alpha=1.0 - d)
        return True

    def state_dict(self) -> dict[str, Tensor]:
        """Shadow weights keyed like the checkpoint's trainable weights."""
        return {f"trainable.{i:04d}": s for i, s in enumerate(self.shadow)}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore :meth:`state_dict`."""
        for i, s in enumerate(self.shadow):
            s.copy_(state[f"trainable.{i:04d}"])

    @contextmanager
    def swapped(self) -> Iterator[None]:
        """Temporarily load the shadow into the live parameters (for evaluation and saving)."""
        backup = [p.detach().clone() for p in self.parameters]
        with torch.no_grad():
            for p, s in zip(self.parameters, self.shadow, strict=True):
                p.copy_(s.to(p.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for p, b in zip(self.parameters, backup, strict=True):
                    p.copy_(b)
