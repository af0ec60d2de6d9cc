"""The recipe's ``eval`` section: its settings, its validated form, and how the recipe checks its components.

Recipe section ``eval`` (all optional except ``prompts`` or ``sets``)::

    eval:
      prompts: {class_path: prompt-list, init_args: {prompts: [...]}}   # one PromptSource, or instead:
      sets:                                                             # several named ones, reported separately
        heldout: {class_path: digit-prompts, init_args: {split: eval}}
        pretrain: {class_path: digit-prompts, init_args: {split: pretrain}}
      rewards: [{class_path: jpeg-compressibility}, {class_path: clipscore}]  # default: the training rewards
      judges: [{class_path: digit-judge}]  # second judges: scored here only, never trained on
      num_steps: 20      # Euler ODE steps (NFE per image, before CFG doubling)
      every: 50          # also evaluated at step 0 (the "before" reference) and at the end; 0 = only those two
      seed: 1234         # prompt i of each set uses torch.Generator().manual_seed(seed + i)
      batch_size: 8
      save_images: true  # per-image PNGs (``eval/step_N/0000.png``, ``eval/<set>/step_N/0000.png``) besides the grid
      alarm: {enabled: true, window: 3, judge_drop: 0.1, stat_drift: 0.08, stop: false}  # evaluation.alarm

Judges are scorers the policy never optimised (the recipe rejects a judge that is also a training reward): a training
reward that rises while the judges stay flat is reward hacking, not a better model. They live only in this section,
so nothing in the training step (rewards, advantages, updates) ever sees them. The section is validated by
:func:`rlpost.engine.evaluation.section.validate_eval`, which the recipe's validation calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from rlpost.core.api import PromptSource, RewardSource
from rlpost.engine.evaluation.alarm import AlarmConfig

__all__ = ["SETTING_HELP", "ComponentChecks", "EvalSettings", "EvalSpec"]


@dataclass
class EvalSettings:
    """Scalar settings of the ``eval`` recipe section (type-checked by jsonargparse)."""

    num_steps: int = 20
    every: int = 0
    seed: int = 1234
    batch_size: int = 8
    save_images: bool = True

    def problems(self) -> list[str]:
        """Range problems, each naming its field relative to the section (the recipe prefixes ``eval.``)."""
        problems = [
            f"{n}: must be >= 1, got {getattr(self, n)}" for n in ("num_steps", "batch_size") if getattr(self, n) < 1
        ]
        if self.every < 0:
            problems.append(f"every: must be >= 0, got {self.every}")
        return problems


SETTING_HELP = {
    "num_steps": "ODE steps (NFE) per evaluation image",
    "every": "evaluate every N training steps, besides step 0 and the last step (0: only those two)",
    "seed": "seed of the evaluation noise (the same images every evaluation)",
    "batch_size": "images per evaluation forward batch",
    "save_images": "per-image PNGs besides the grid",
}
"""Command-line help of each :class:`EvalSettings` field (``rlpost train --help``)."""


@dataclass
class EvalSpec:
    """The validated ``eval`` section: components plus settings.

    Attributes:
        sets: Evaluation prompt sources by name, in recipe order. A recipe's single ``eval.prompts`` source is the
            one unnamed set ``""`` (its metrics keep the short names ``eval/<reward>``).
        rewards: Evaluation rewards (may include ones not trained on); shared instances with training rewards
            whose resolved configuration is identical, so their weights load once.
        judges: Second judges: never training rewards, scored and logged next to ``rewards``.
        settings: NFE, interval, seed, batch size.
        alarm: The reward-hacking alarm's settings (``eval.alarm``), or ``None``.
        trained: Names of the evaluation rewards that are also training rewards (the ones the alarm watches).
    """

    sets: dict[str, PromptSource]
    rewards: list[RewardSource]
    judges: list[RewardSource] = field(default_factory=list)
    settings: EvalSettings = field(default_factory=EvalSettings)
    alarm: AlarmConfig | None = None
    trained: list[str] = field(default_factory=list)


class ComponentChecks(Protocol):
    """How the recipe resolves and type-checks one component (``rlpost.engine.recipe.validate`` provides it), so the
    ``eval`` section is checked exactly like the training sections without this package importing the recipe's."""

    def resolve(self, value: Any, where: str, kind: str, problems: list[str]) -> Any:
        """``value`` (a registered name, class name or class path, maybe with arguments) as ``{class_path,
        init_args}``, or ``None`` after recording a problem naming ``where``."""
        ...

    def check(self, key: str, typ: Any, value: Any, problems: list[str], where: str) -> Any:
        """``value`` type-checked and instantiated as ``typ`` by jsonargparse under the option ``key``, or ``None``
        after recording a problem naming ``where``."""
        ...
