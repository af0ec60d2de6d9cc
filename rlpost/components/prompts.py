"""The seeded prompt stream, and the registration of the built-in prompt sources (local text/JSONL/CSV files and
inline lists: :mod:`rlpost.components.prompt_sources`; Hugging Face ``datasets``: :mod:`rlpost.components.hub_prompts`).

The stream shuffles the prompt list with a generator seeded from ``(seed, epoch)``, so the order of every epoch is
reproducible and independent of how many steps earlier epochs took; its state is two integers (epoch, position).
"""

from __future__ import annotations

from typing import Any

import torch

from rlpost.components.hub_prompts import HFDatasetPrompts
from rlpost.components.prompt_selection import SpreadFilter
from rlpost.components.prompt_sources import PromptFile, PromptList
from rlpost.core.api import PromptSource
from rlpost.core.contract import PromptBatch, RewardScores, Rollout
from rlpost.core.hookspecs import hookimpl
from rlpost.core.registry import Registry

__all__ = ["PromptStream"]


class PromptStream:
    """Deterministic, epoch-aware stream of prompt groups.

    Args:
        items: ``(prompt, metadata)`` pairs.
        seed: Root seed; epoch ``e`` is shuffled with a generator seeded ``seed * 1_000_003 + e``.
        shuffle: Shuffle each epoch (otherwise file order).
        selector: Optional :class:`~rlpost.components.prompt_selection.SpreadFilter`: prompts it declines are
            passed over (consumed for the epoch) and the batch is filled from the prompts after them; feed it with
            :meth:`observe`.
    """

    def __init__(
        self,
        items: list[tuple[str, dict[str, Any]]],
        seed: int,
        shuffle: bool = True,
        selector: SpreadFilter | None = None,
    ) -> None:
        if not items:
            raise ValueError("PromptStream: no prompts")
        self.items = items
        self.seed = seed
        self.shuffle = shuffle
        self.selector = selector
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.items)))
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.items), generator=gen).tolist()

    def next_batch(self, num_groups: int, samples_per_group: int) -> PromptBatch:
        """The next ``num_groups`` prompts (crossing epoch boundaries as needed)."""
        prompts: list[str] = []
        metadata: list[dict[str, Any]] = []
        if self.selector is not None:
            self.selector.begin_batch()
        while len(prompts) < num_groups:
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            prompt, meta = self.items[self._order[self.position]]
            self.position += 1
            # Terminates: the selector declines a prompt at most ``max_skips`` times in a row.
            if self.selector is not None and not self.selector.admit(prompt):
                continue
            prompts.append(prompt)
            metadata.append(dict(meta))
        return PromptBatch(prompts=prompts, metadata=metadata, samples_per_group=samples_per_group)

    def observe(self, rollout: Rollout, scores: RewardScores) -> None:
        """Show the selector a step's groups and rewards (the view gathered over all ranks); no-op without one."""
        if self.selector is not None:
            self.selector.observe(rollout, scores)

    def metrics(self) -> dict[str, float]:
        """The selector's metrics (``prompts/...``); empty without one."""
        return self.selector.metrics() if self.selector is not None else {}

    def state_dict(self) -> dict[str, Any]:
        """Epoch and position (the permutation is recomputed from the seed), and the selector's records."""
        state: dict[str, Any] = {"epoch": self.epoch, "position": self.position}
        if self.selector is not None:
            state["selector"] = self.selector.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (a checkpoint without selector records starts the selector afresh)."""
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)
        if self.selector is not None and "selector" in state:
            self.selector.load_state_dict(state["selector"])


@hookimpl
def rlpost_register_prompt_sources(register: Registry[PromptSource]) -> None:
    """Register the built-in prompt sources."""
    register(PromptList)
    register(PromptFile)
    register(HFDatasetPrompts)
