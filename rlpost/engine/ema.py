"""Exponential moving average of the trainable weights (optional; recipe section ``ema``).

When enabled, held-out evaluation and the diffusers-loadable artefacts of checkpoints/exports use the EMA weights
(swapped in with :meth:`EMA.swapped`); the live weights keep training and are what resume restores.

The update is torch's multi-tensor EMA, ``torch.optim.swa_utils.get_ema_multi_avg_fn`` (one ``_foreach_lerp_``
over all shadow tensors), applied to plain lists of tensors. We chose it over the two other well-kept EMAs:

* ``torch.optim.swa_utils.AveragedModel`` deep-copies a whole module: for a LoRA policy that copies the frozen base
  model, and a ZeRO-3 module's deep copy holds empty parameter placeholders;
* diffusers' ``EMAModel`` (huggingface/diffusers src/diffusers/training_utils.py@v0.42.1) clones the parameters
  when it is built (under ZeRO-3 those are the empty placeholders: the very crash this module once had), gathers
  every full parameter at every update only when it detects ZeRO-3 through transformers' global DeepSpeed config
  (which rlpost never sets), and ramps the decay up with a schedule of its own ((1+n)/(10+n) capped at ``decay``),
  which would change what ``ema.decay`` means.

A list-of-tensors update lets the EMA hold exactly the part of each weight that this rank owns. Which part that is
comes from a :class:`WeightShards`: :class:`ReplicatedWeights` (the parameters themselves; single process and
unsharded DeepSpeed) or, under DeepSpeed ZeRO 1-3, this rank's slice of the fp32 master weights
(:meth:`rlpost.engine.distributed.DeepSpeedBackend.weight_shards`). So the shadow is sharded like the optimizer state
(4 bytes per parameter divided by the number of ranks) and every rank updates its own slice without communication;
only :meth:`EMA.state_dict` (checkpoints) and :meth:`EMA.swapped` (evaluation, artefacts) gather, and under ZeRO they
are collective calls that every rank must make.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn
from torch.optim.swa_utils import get_ema_multi_avg_fn

from rlpost.engine.checkpoint import CheckpointError

__all__ = ["EMA", "EMAConfig", "ReplicatedWeights", "WeightShards"]


@dataclass
class EMAConfig:
    """Recipe section ``ema``.

    Attributes:
        decay: ``shadow <- decay·shadow + (1-decay)·weights`` at every update, in ``[0, 1)``.
        update_every: Update the shadow every N training steps (N >= 1).
    """

    decay: float = 0.999
    update_every: int = 1

    def problems(self) -> list[str]:
        """Range problems, each naming its field relative to the section (``decay: ...``; the recipe prefixes
        ``ema.``)."""
        problems = []
        if not 0.0 <= self.decay < 1.0:
            problems.append(f"decay: must be in [0, 1), got {self.decay}")
        if self.update_every < 1:
            problems.append(f"update_every: must be >= 1, got {self.update_every}")
        return problems


class WeightShards(Protocol):
    """This rank's share of each trainable parameter, and how to go between shares and full tensors."""

    def local(self) -> list[Tensor]:
        """fp32 values of this rank's share of each parameter, in parameter order (an empty tensor where this rank
        holds none); views where possible, read afresh at every call."""
        ...

    def gather(self, shards: Sequence[Tensor]) -> list[Tensor]:
        """Full fp32 tensors (parameter shapes) assembled from every rank's ``shards``; collective when sharded."""
        ...

    def scatter(self, full: Sequence[Tensor]) -> list[Tensor]:
        """This rank's share of each full tensor (the inverse of :meth:`gather`)."""
        ...

    def loaded(self, shards: Sequence[Tensor]) -> AbstractContextManager[None]:
        """Let the module compute with ``shards`` in place of the live weights, restored exactly on exit;
        collective when sharded."""
        ...


@contextmanager
def swapped_in(parameters: Sequence[nn.Parameter], values: Iterable[Tensor]) -> Iterator[None]:
    """Copy ``values`` into ``parameters`` (one at a time, in order, so a lazy iterable may gather each value just
    before it is copied), and copy the backed-up live values back on exit.

    The copies go through ``p.data``, which autograd does not version: a graph that saved a parameter before the swap
    (a live forward with gradients, then a no-grad forward under a weight copy, then ``backward``) still
    backpropagates, and correctly, because the live values are back in place before ``backward`` runs."""
    backup = []
    with torch.no_grad():
        for p, v in zip(parameters, values, strict=True):
            backup.append(p.data.clone())
            p.data.copy_(v)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, b in zip(parameters, backup, strict=True):
                p.data.copy_(b)


class ReplicatedWeights:
    """Every process holds the full parameters (single process, DeepSpeed stage 0 without bf16).

    Args:
        parameters: The trainable parameters.
    """

    def __init__(self, parameters: Sequence[nn.Parameter]) -> None:
        self.parameters = list(parameters)

    def local(self) -> list[Tensor]:
        """The parameters (as fp32; no copy when they are fp32 already)."""
        return [p.detach().float() for p in self.parameters]

    def gather(self, shards: Sequence[Tensor]) -> list[Tensor]:
        """The shards are the full tensors already."""
        return list(shards)

    def scatter(self, full: Sequence[Tensor]) -> list[Tensor]:
        """Full tensors, checked against the parameter shapes."""
        out = []
        for i, (p, value) in enumerate(zip(self.parameters, full, strict=True)):
            if tuple(value.shape) != tuple(p.shape):
                raise CheckpointError(f"EMA tensor {i}: checkpoint shape {tuple(value.shape)} != {tuple(p.shape)}")
            out.append(value.to(p.device, torch.float32))
        return out

    def loaded(self, shards: Sequence[Tensor]) -> AbstractContextManager[None]:
        """Copy ``shards`` into the parameters; copy the backed-up live values back on exit."""
        return swapped_in(self.parameters, shards)


class EMA:
    """fp32 shadow of this rank's share of the trainable weights.

    Args:
        parameters: The trainable parameters (same order as ``Policy.trainable_parameters()``).
        config: Decay and update interval.
        shards: Where this rank's share lives; default :class:`ReplicatedWeights` (the full parameters).
    """

    def __init__(self, parameters: list[nn.Parameter], config: EMAConfig, shards: WeightShards | None = None) -> None:
        self.parameters = parameters
        self.config = config
        self.shards: WeightShards = shards if shards is not None else ReplicatedWeights(parameters)
        # (torch leaves this helper unannotated)
        self._average: Callable[[list[Tensor], list[Tensor], int], None] = get_ema_multi_avg_fn(config.decay)  # type: ignore[no-untyped-call]
        # The shadow starts as a copy of this rank's share of the weights (a slice of a ZeRO partition, not the
        # parameter object, which ZeRO-3 has already emptied).
        self.shadow = [t.detach().to(torch.float32, copy=True) for t in self.shards.local()]

    @torch.no_grad()
    def update(self, step: int) -> bool:
        """Update the shadow after completed training step ``step`` when due; returns whether it updated."""
        if step % self.config.update_every:
            return False
        pairs = [(s, w) for s, w in zip(self.shadow, self.shards.local(), strict=True) if s.numel()]
        if pairs:
            self._average([s for s, _ in pairs], [w.to(s.device) for s, w in pairs], 0)
        return True

    def state_dict(self) -> dict[str, Tensor]:
        """Full fp32 shadow weights keyed like the checkpoint's trainable weights (CPU tensors).

        A collective call under ZeRO (the shards are gathered): every rank must make it.
        """
        full = self.shards.gather(self.shadow)
        return {f"trainable.{i:04d}": t.detach().cpu() for i, t in enumerate(full)}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore :meth:`state_dict`: every rank keeps its own share of the full tensors.

        Raises:
            CheckpointError: The state does not hold one tensor of the right size per trainable parameter.
        """
        keys = [f"trainable.{i:04d}" for i in range(len(self.shadow))]
        if sorted(state) != keys:
            raise CheckpointError(
                f"the checkpoint's EMA holds {len(state)} tensors but the policy has {len(self.shadow)} trainable "
                "parameters"
            )
        with torch.no_grad():
            for s, value in zip(self.shadow, self.shards.scatter([state[k] for k in keys]), strict=True):
                s.copy_(value)

    @contextmanager
    def swapped(self) -> Iterator[None]:
        """Temporarily let the policy compute with the EMA weights (evaluation, saving artefacts).

        A collective call under ZeRO, on entry and on exit: every rank must enter it.
        """
        with self.shards.loaded(self.shadow):
            yield
