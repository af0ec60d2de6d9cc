"""What the DGPO tests share: a hand-built clean-sample rollout, a backend that keeps the gradient, the step's copies,
and a policy wrapper that records every velocity call."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from rlpost.core.api import Advantages, TrainBackend, UpdateContext
from rlpost.core.contract import PromptBatch, Rollout
from rlpost.engine.weight_copies import CopyConfig, EngineCopies
from rlpost.ops.sampling import RolloutBuilder
from rlpost_dgpo.update import EMA_REF

PROMPTS = ("a photo of a cat", "a red car on a street", "a bowl of fruit", "a city at night")
NUM_STEPS = 6


def clean_rollout(policy: Any, groups: Sequence[int], per_group: int, seed: int = 0) -> Rollout:
    """A rollout of clean samples only (no edges: what the ODE ``solver`` sampler leaves a likelihood-free rule) for
    the global groups ``groups`` (consecutive), ``per_group`` samples each, ``x0`` drawn from ``seed`` per global
    sample so that any split of the groups over "ranks" sees the same samples."""
    offset = groups[0]
    assert list(groups) == list(range(offset, offset + len(groups)))
    batch = PromptBatch([PROMPTS[g % len(PROMPTS)] for g in groups], [{} for _ in groups], per_group, offset)
    builder = RolloutBuilder(batch, policy.sigmas(NUM_STEPS), ["euler"])
    x0 = torch.cat([policy.initial_noise(per_group, torch.Generator().manual_seed(seed + 100 * g)) for g in groups])
    local = torch.arange(len(groups)).repeat_interleave(per_group)
    nodes = builder.add_nodes(0.5 * x0, NUM_STEPS, local)
    media = torch.zeros(len(nodes), 1, 4, 4, 3, dtype=torch.uint8)
    return builder.build(nodes, media)


def advantages_of(values: Sequence[float]) -> Advantages:
    return Advantages(edges=torch.zeros(0), samples=torch.tensor(list(values), dtype=torch.float32))


class GradBackend(TrainBackend):
    """Keeps the accumulated gradient of each ``step`` (the weights stay put), so a test can compare the gradient of
    an update with one it computes itself."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.grads: list[list[Tensor]] = []
        self.losses: list[float] = []

    def backward(self, loss: Tensor) -> None:
        self.losses.append(float(loss))
        loss.backward()

    def step(self) -> dict[str, float]:
        self.grads.append([torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in self.params])
        for p in self.params:
            p.grad = None
        return {"train/lr": 0.0}


@dataclass
class Call:
    """One recorded velocity call: inputs, guidance and which weights ran."""

    latents: Tensor
    sigma: Tensor
    guidance: float | None
    weights: str


@dataclass
class Recorder:
    """Wraps ``policy.velocity`` (an instance attribute, undone by :meth:`close`) and notes each call and the copy it
    ran under (``copies.active``)."""

    policy: Any
    copies: Any
    calls: list[Call] = field(default_factory=list)

    def __post_init__(self) -> None:
        inner = type(self.policy).velocity.__get__(self.policy)

        def velocity(latents: Tensor, sigma: Tensor, cond: Any, guidance: float | None = None) -> Tensor:
            self.calls.append(Call(latents.detach().clone(), sigma.detach().clone(), guidance, self.copies.active))
            return inner(latents, sigma, cond, guidance=guidance)

        self.policy.velocity = velocity

    def close(self) -> None:
        del self.policy.velocity


class NamedCopies(EngineCopies):
    """The engine's copies, noting which one is in use (``"live"`` outside ``use``)."""

    active = "live"

    def use(self, name: str) -> Any:
        inner = super().use(name)
        outer = self

        class _Ctx:
            def __enter__(self) -> None:
                outer.active = name
                inner.__enter__()

            def __exit__(self, *exc: Any) -> None:
                inner.__exit__(*exc)
                outer.active = "live"

        return _Ctx()


def copies_for(policy: Any, ema_shift: float = 0.0, seed: int = 1) -> NamedCopies:
    """The run's copies with an ``ema_ref`` copy, moved off the live weights by ``ema_shift``-scaled noise."""
    copies = NamedCopies(policy, policy.trainable_parameters(), {EMA_REF: CopyConfig(rate=0.001, cap=0.3)})
    gen = torch.Generator().manual_seed(seed)
    copies.shadows[EMA_REF] = [t + ema_shift * torch.randn(t.shape, generator=gen) for t in copies.shadows[EMA_REF]]
    return copies


def context(
    policy: Any, rollout: Rollout, adv: Advantages, backend: TrainBackend, copies: Any, seed: int = 0, step: int = 3
) -> UpdateContext:
    return UpdateContext(policy, None, rollout, adv, backend, torch.Generator().manual_seed(0), step, copies, seed)  # type: ignore[arg-type]
