"""Single-process training backend: plain torch autograd, a torch optimizer and an optional LR scheduler.

The DeepSpeed backend (``rlpost.engine.distributed``) implements the same :class:`~rlpost.core.api.TrainBackend`
interface, so policy-update rules never know which one runs.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from rlpost.core.api import TrainBackend

__all__ = ["LocalBackend"]


class LocalBackend(TrainBackend):
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
        """Accumulate gradients of ``loss``."""
        loss.backward()  # type: ignore[no-untyped-call]

    def step(self) -> dict[str, float]:
        """Clip, step and zero gradients; a step whose gradient norm is not finite is skipped (weights untouched)."""
        norm = self._grad_norm()
        metrics = {"train/grad_norm": norm, "train/lr": float(self.optimizer.param_groups[0]["lr"])}
        if not math.isfinite(norm):
            # Never let a NaN/inf gradient reach the weights; the step is counted so the run can react.
            self.skipped_steps += 1
            metrics["train/nonfinite_grad_steps"] = 1.0
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
