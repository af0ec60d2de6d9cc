"""The digits world: a tiny real-architecture SD3 pretrained on sklearn digits, a frozen digits classifier, the
``digit-alignment`` reward, an independent second judge (``digit-judge``, for evaluation) and the ``digit-prompts``
prompt source. A complete, download-free RL post-training setting for CPUs (``docs/digits.md``).

Registering costs nothing: the hooks import their modules lazily, and weights load in ``setup()``.
"""

from __future__ import annotations

from rlpost import PromptSource, Registry, RewardSource, hookimpl, shipped_asset

__all__ = ["DIGITS_SD3_DIR", "rlpost_register_prompt_sources", "rlpost_register_reward_sources"]

DIGITS_SD3_DIR = shipped_asset("digits-sd3")
"""The shipped digits pipeline (``assets/digits-sd3`` shipped with the package: ``rlpost.shipped_asset``)."""


@hookimpl
def rlpost_register_reward_sources(register: Registry[RewardSource]) -> None:
    """Register ``digit-alignment`` (the training reward), ``digit-judge`` (the evaluation-only second judge) and
    ``digits-brightness`` (a deliberately hackable demonstration reward for the reward-hacking alarm)."""
    from rlpost_digits.reward import DigitAlignmentReward, DigitJudgeReward, DigitsBrightnessReward

    register(DigitAlignmentReward)
    register(DigitJudgeReward)
    register(DigitsBrightnessReward)


@hookimpl
def rlpost_register_prompt_sources(register: Registry[PromptSource]) -> None:
    """Register ``digit-prompts``."""
    from rlpost_digits.prompts import DigitsPrompts

    register(DigitsPrompts)
