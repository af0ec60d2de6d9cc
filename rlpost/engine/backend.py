"""Training backends as the engine sees them, the single-process one, and device resolution.

:class:`EngineBackend` is what the runner needs of a backend beyond the update rule's
:class:`~rlpost.core.api.TrainBackend` (whole weights for checkpoints, this rank's share of them for the EMA), so the
runner never branches on which backend runs. :class:`LocalBackend` is plain torch autograd, a torch optimizer and an
optional LR scheduler; the DeepSpeed backend (``rlpost.engine.distributed``) implements the same interface.
"""

from __future__ import annotations

import contextlib
import math
from abc import abstractmethod
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from rlpost.core.api import TrainBackend
from rlpost.engine.weights import load_trainable, trainable_weights

if TYPE_CHECKING:
    from rlpost.engine.ema import WeightShards

__all__ = ["EngineBackend", "LocalBackend", "resolve_device"]


def resolve_device(spec: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; anything else is passed to ``torch.device``."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


class EngineBackend(TrainBackend):
    """A :class:`~rlpost.core.api.TrainBackend` the runner can checkpoint: it owns the trainable parameters, the torch
    optimizer and LR scheduler, and hands out whole weights however it stores them.

    Attributes:
        parameters: The trainable parameters, in ``Policy.trainable_parameters()`` order.
        optimizer: The torch optimizer (or a view whose ``state_dict`` is the whole, consolidated state).
        scheduler: The LR scheduler, or ``None``.
        num_steps: Optimizer steps taken; ``skipped_steps`` steps skipped for a non-finite gradient.
        refused_losses: Non-finite losses :meth:`backward` refused (no gradient), since the backend was built.
    """

    parameters: Sequence[nn.Parameter]
    optimizer: Any
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    num_steps: int
    skipped_steps: int
    refused_losses: int = 0

    def refuse_nonfinite(self, loss: Tensor) -> bool:
        """Count and refuse a non-finite ``loss``: ``True`` when :meth:`backward` must not use it.

        The guards read this count (and ``skipped_steps``) themselves, so a non-finite loss is caught whether or not
        the update rule checked it first (``rlpost.engine.runner``)."""
        if bool(torch.isfinite(loss.detach()).all()):
            return False
        self.refused_losses += 1
        return True

    @abstractmethod
    def full_state_dict(self) -> dict[str, Tensor]:
        """The trainable weights whole, keyed ``trainable.NNNN`` (a collective call when weights are sharded)."""

    @abstractmethod
    def load_full_state_dict(self, weights: dict[str, Tensor]) -> None:
        """Copy what :meth:`full_state_dict` returned into the live weights (and any sharded master copy).

        Raises:
            CheckpointError: The count or a shape differs from the policy's trainable parameters.
        """

    def weight_shards(self) -> WeightShards | None:
        """This rank's share of the trainable weights for the EMA, or ``None`` when every rank holds them whole."""
        return None

    def gathered(self) -> AbstractContextManager[None]:
        """The trainable parameters whole in the module while the context is open (a no-op unless partitioned)."""
        return contextlib.nullcontext()


class LocalBackend(EngineBackend):
    """Gradients accumulate across :meth:`backward` calls until :meth:`step`.

    Args:
        parameters: The trainable parameters (already handed to ``optimizer``).
        optimizer: The torch optimizer.
        scheduler: Optional LR scheduler, stepped after every optimizer step.
        max_grad_norm: Clip the global gradient norm to this value before each step; ``None`` disables clipping.
    """

    def __init__(
        self,
        parameters: list[nn.Parameter],
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        max_grad_norm: float | None = 1.0,
    ) -> None:
        if not parameters:
            raise ValueError("LocalBackend: the policy exposes no trainable parameters")
        self.parameters = parameters
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.max_grad_norm = max_grad_norm
        self.num_steps = 0
        self.skipped_steps = 0

    def backward(self, loss: Tensor) -> None:
        """Accumulate gradients of ``loss`` (a non-finite one is refused and counted: :meth:`refuse_nonfinite`)."""
        if self.refuse_nonfinite(loss):
            return
        loss.backward()  # type: ignore[no-untyped-call]

    def step(self) -> dict[str, float]:
        """Clip, step and zero gradients; a step whose gradient norm is not finite is skipped (weights untouched)."""
        norm = self._grad_norm()
        metrics = {"train/grad_norm": norm, "train/lr": float(self.optimizer.param_groups[0]["lr"])}
        if not math.isfinite(norm):
            # Never let a NaN/inf gradient reach the weights; the step is counted so the run can react.
            self.skipped_steps += 1
            self.optimizer.zero_grad(set_to_none=True)
            return metrics
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.parameters, self.max_grad_norm)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.num_steps += 1
        return metrics

    def _grad_norm(self) -> float:
        grads = [p.grad.detach().float().norm() for p in self.parameters if p.grad is not None]
        if not grads:
            return 0.0
        return float(torch.stack(grads).norm())

    def full_state_dict(self) -> dict[str, Tensor]:
        """The trainable parameters keyed by position (detached, not copied)."""
        return trainable_weights(self.parameters)

    def load_full_state_dict(self, weights: dict[str, Tensor]) -> None:
        """Copy checkpointed weights into the trainable parameters."""
        load_trainable(self.parameters, weights)
