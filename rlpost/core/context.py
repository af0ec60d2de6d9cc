"""What lifecycle hooks see of a run: :class:`RunContext`, and how it ended: :class:`RunStatus`.

It lives in the plugin kernel, below the engine that fills it in, so the hook specifications (and a plugin reading
them) depend on nothing above ``rlpost.core``. What a hook may read of the recipe is declared here as the read-only
:class:`RecipeView`; the engine's ``rlpost.engine.recipe.Recipe`` satisfies it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

from rlpost.core.api import AdvantageEstimator, Policy, PolicyOptimizer, PromptSource, RewardSource, Sampler
from rlpost.core.contract import Stash

__all__ = ["RecipeView", "RunContext", "RunSettings", "RunStatus"]


class RunStatus(str, Enum):
    """How a run ended: ``rlpost_after_run``'s ``status``, ``summary.json``'s ``"status"`` and ``Runner.status``.

    A ``str`` enum: each member equals its value (``RunStatus.STOPPED == "stopped"``), so code comparing the plain
    strings keeps working.
    """

    COMPLETED = "completed"
    """Every one of ``run.max_steps`` steps ran."""
    STOPPED = "stopped"
    """The reward-hacking alarm asked the run to end early (``eval.alarm.stop``, ``docs/logging.md``); a checkpoint of
    the last step was saved (with ``checkpoint.at_end``)."""
    FAILED = "failed"
    """An exception ended the run (a guard stop, a plugin failure, a bug)."""
    INTERRUPTED = "interrupted"
    """``KeyboardInterrupt`` (Ctrl-C) ended the run."""

    def __str__(self) -> str:
        return self.value


class RunSettings(Protocol):
    """The recipe's ``run`` section as hooks may read it."""

    @property
    def max_steps(self) -> int:
        """Number of training steps of the run."""

    @property
    def seed(self) -> int:
        """Root seed."""

    @property
    def output_dir(self) -> str:
        """Run directory as the recipe names it."""


class RecipeView(Protocol):
    """The validated recipe as hooks may read it: its components, run settings and resolved plain data."""

    @property
    def run(self) -> RunSettings:
        """Run settings."""

    @property
    def model(self) -> Policy:
        """The policy adapter."""

    @property
    def prompts(self) -> PromptSource:
        """The prompt source."""

    @property
    def sampler(self) -> Sampler:
        """The sampler."""

    @property
    def rewards(self) -> Sequence[RewardSource]:
        """The reward sources."""

    @property
    def advantage(self) -> AdvantageEstimator:
        """The advantage estimator."""

    @property
    def optimizer(self) -> PolicyOptimizer:
        """The policy-update rule."""

    @property
    def config(self) -> Mapping[str, Any]:
        """The resolved recipe as plain data (what the run directory stores)."""


@dataclass
class RunContext:
    """What lifecycle hooks see.

    Attributes:
        recipe: The validated recipe with its components.
        output_dir: The run directory.
        step: Number of completed steps.
        rank: This process's rank; ``world_size`` the number of ranks.
        stash: Typed plugin-private state for the run.
        history: Metrics of every completed step (main process).
    """

    recipe: RecipeView
    output_dir: Path
    step: int = 0
    rank: int = 0
    world_size: int = 1
    stash: Stash = field(default_factory=Stash)
    history: list[dict[str, float]] = field(default_factory=list)

    @property
    def is_main_process(self) -> bool:
        """True on rank 0 (the only rank that prints or writes shared files)."""
        return self.rank == 0
