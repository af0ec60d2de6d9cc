"""Named weight copies (recipe section ``copies``): lagging sets of the trainable weights that a rollout can run
under and a loss can evaluate (:class:`rlpost.core.api.WeightCopies`).

A copy is an fp32 shadow of this rank's share of the trainable parameters, kept and swapped exactly like the EMA
(:mod:`rlpost.engine.ema`, whose :class:`~rlpost.engine.ema.WeightShards` do the work): under one process and
unsharded DeepSpeed the shadow has the parameters' shapes; under ZeRO 1-3 it is this rank's slice of the fp32 master
weights, so a copy costs 4 bytes per trainable parameter divided by the number of ranks, and ``use`` swaps the slices
in (collective, like :meth:`EMA.swapped`). For LoRA the trainable parameters are the adapter's, so a copy is
adapter-sized, the size of a second peft adapter; for full fine-tuning it is transformer-sized, and ``offload: true``
keeps it in CPU memory between uses. We swap values into the one adapter rather than keep extra peft adapters
(``set_adapter``) so one code path serves every model adapter, full fine-tuning and ZeRO-3 partitions.

Schedule: every copy starts equal to the live weights (DiffusionNFT initialises "old" from the policy,
NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py`` @24af555 L576-579) and after completed training step ``k`` (when
``k % update_every == 0``) becomes ``d(k)·copy + (1 - d(k))·live`` with ``d(k) = min(cap, rate·max(0, k - delay))``.
That one law covers the published schedules: DiffusionNFT's decay type 1 ``min(0.001k, 0.5)`` and type 2 (0 until
step 75, then ``min(0.0075(k - 75), 0.999)``) (same file L169-189), and the ``min(0.001k, 0.3)`` of AWM's KL-EMA and
DGPO's EMA reference (scxue/advantage_weighted_matching ``advantage_weighted_matching/scripts/train_sd3_awm.py``
@be51372 L1409-1419; Luo-Yihong/DGPO ``scripts/train_sd3_dgpo.py`` @01ceb4b L1175-1177). Upstream counts optimizer
steps; rlpost counts training steps, which is the same count for their presets (one optimizer step per rollout).
The copies are saved in every checkpoint (the run state) and restored exactly, so a resumed run continues them bit for
bit.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rlpost.core.api import LIVE, REFERENCE, Policy, WeightCopies
from rlpost.engine.checkpoint import CheckpointError
from rlpost.engine.ema import ReplicatedWeights, WeightShards

__all__ = ["COPY_NAME", "CopyConfig", "EngineCopies", "copies_problems"]

COPY_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
"""What a copy may be called: lower-case, starting with a letter, at most 32 characters."""


@dataclass
class CopyConfig:
    """One named weight copy (recipe section ``copies``: ``{name: {rate, cap, delay, update_every, offload}}``).

    After completed training step ``k`` with ``k % update_every == 0`` the copy becomes
    ``d·copy + (1 - d)·live`` with ``d = min(cap, rate·max(0, k - delay))``; ``d = 0`` makes it the live weights.

    Attributes:
        rate: Growth of the decay per training step (``>= 0``).
        cap: Largest decay, in ``[0, 1]`` (``1`` with ``rate > 0`` eventually freezes the copy).
        delay: Steps before the decay starts growing (``>= 0``).
        update_every: Update the copy every N training steps (``>= 1``).
        offload: Keep the copy in CPU memory between uses (full fine-tuning of a large model).
    """

    rate: float = 0.001
    cap: float = 0.5
    delay: int = 0
    update_every: int = 1
    offload: bool = False

    def decay(self, step: int) -> float:
        """``d(step)``: the weight the copy keeps at the update after completed step ``step``."""
        return min(self.cap, self.rate * max(0, step - self.delay))

    def problems(self) -> list[str]:
        """Range problems, each naming its field relative to the copy."""
        problems = []
        if not (math.isfinite(self.rate) and self.rate >= 0):
            problems.append(f"rate: must be a finite number >= 0, got {self.rate}")
        if not (math.isfinite(self.cap) and 0 <= self.cap <= 1):
            problems.append(f"cap: must be in [0, 1], got {self.cap}")
        if self.delay < 0:
            problems.append(f"delay: must be >= 0, got {self.delay}")
        if self.update_every < 1:
            problems.append(f"update_every: must be >= 1, got {self.update_every}")
        return problems


def copies_problems(copies: Mapping[str, CopyConfig] | None, required: frozenset[str], rule: str) -> list[str]:
    """Problems of a recipe's ``copies`` section, and the copies the update rule ``rule`` needs that it lacks."""
    copies = copies or {}
    problems = []
    for name, cfg in copies.items():
        if name in (REFERENCE, LIVE) or not COPY_NAME.match(name):
            why = "is reserved" if name in (REFERENCE, LIVE) else "must be lower-case letters, digits, '_' or '-'"
            problems.append(f"copies.{name}: the name {why}")
        problems.extend(f"copies.{name}.{p}" for p in cfg.problems())
    for name in sorted(required - {REFERENCE} - set(copies)):
        problems.append(
            f"copies: optimizer {rule!r} needs a weight copy {name!r}; declare it, e.g. "
            f"'copies: {{{name}: {{rate: 0.001, cap: 0.5}}}}' (docs/checkpoints.md, 'Weight copies')"
        )
    return problems


class EngineCopies(WeightCopies):
    """The run's weight copies: shadows of this rank's share of the trainable weights, one per configured name.

    Args:
        policy: The policy (its :meth:`~rlpost.core.api.Policy.reference` serves ``"reference"``).
        parameters: The trainable parameters (same order as ``Policy.trainable_parameters()``).
        configs: Name -> schedule.
        shards: Where this rank's share lives (default: the full parameters).
    """

    def __init__(
        self,
        policy: Policy,
        parameters: Sequence[nn.Parameter],
        configs: Mapping[str, CopyConfig],
        shards: WeightShards | None = None,
    ) -> None:
        self.policy = policy
        self.configs = dict(configs)
        self.shards: WeightShards = shards if shards is not None else ReplicatedWeights(list(parameters))
        live = self.shards.local()
        self.shadows: dict[str, list[Tensor]] = {
            name: [t.detach().to("cpu" if cfg.offload else t.device, torch.float32, copy=True) for t in live]
            for name, cfg in self.configs.items()
        }

    def names(self) -> tuple[str, ...]:
        return (REFERENCE, *sorted(self.configs))

    def use(self, name: str) -> AbstractContextManager[None]:
        if name == REFERENCE:
            return self.policy.reference()
        if name == LIVE:
            return nullcontext()
        if name not in self.shadows:
            raise KeyError(f"no weight copy {name!r}: this run keeps {', '.join(self.names())} (recipe 'copies')")
        return self._loaded(self.shadows[name])

    @contextmanager
    def _loaded(self, shadow: list[Tensor]) -> Iterator[None]:
        with torch.no_grad(), self.shards.loaded(shadow):
            yield

    @torch.no_grad()
    def update(self, step: int) -> dict[str, float]:
        """Update every copy due after completed training step ``step``; returns ``{copies/<name>_decay: d}`` of
        the ones updated."""
        updated: dict[str, float] = {}
        live = None
        for name, cfg in self.configs.items():
            if step % cfg.update_every:
                continue
            live = self.shards.local() if live is None else live
            d = cfg.decay(step)
            pairs = [(s, w) for s, w in zip(self.shadows[name], live, strict=True) if s.numel()]
            if pairs:  # s <- s + (1 - d)(w - s) = d·s + (1 - d)·w
                torch._foreach_lerp_([s for s, _ in pairs], [w.to(s.device, torch.float32) for s, w in pairs], 1 - d)
            updated[f"copies/{name}_decay"] = d
        return updated

    def state_dict(self) -> dict[str, dict[str, Tensor]]:
        """Name -> full fp32 tensors keyed ``trainable.NNNN`` (CPU). Collective under ZeRO."""
        out = {}
        for name, shadow in self.shadows.items():
            full = self.shards.gather(shadow)
            out[name] = {f"trainable.{i:04d}": t.detach().cpu().clone() for i, t in enumerate(full)}
        return out

    def load_state_dict(self, state: Mapping[str, Mapping[str, Tensor]]) -> None:
        """Restore :meth:`state_dict` (every rank keeps its share).

        Raises:
            CheckpointError: A copy is missing, or does not hold one tensor per trainable parameter.
        """
        missing = sorted(set(self.shadows) - set(state))
        if missing:
            raise CheckpointError(f"the checkpoint holds no weight copy {missing} that the recipe's 'copies' declares")
        for name, shadow in self.shadows.items():
            tensors = state[name]
            keys = [f"trainable.{i:04d}" for i in range(len(shadow))]
            if sorted(tensors) != keys:
                raise CheckpointError(
                    f"weight copy {name!r}: the checkpoint holds {len(tensors)} tensors but the policy has "
                    f"{len(shadow)} trainable parameters"
                )
            with torch.no_grad():
                for s, value in zip(shadow, self.shards.scatter([tensors[k] for k in keys]), strict=True):
                    s.copy_(value.to(s.device))
