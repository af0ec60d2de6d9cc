"""First-party reward sources for rlpost, registered through the ``rlpost`` entry-point group like any plugin.

Modules are imported lazily by the hook so that registering costs nothing; heavy models load in ``setup()``.
See ``docs/rewards.md``.
"""

from __future__ import annotations

from rlpost import Registry, RewardSource, hookimpl


@hookimpl
def rlpost_register_reward_sources(register: Registry[RewardSource]) -> None:
    """Register the built-in reward sources."""
    from .aesthetic import AestheticReward
    from .clipscore import CLIPScoreReward
    from .hps import HPSv2Reward
    from .imagereward import ImageRewardReward
    from .jpeg import JpegCompressibility, JpegIncompressibility
    from .pickscore import PickScoreReward
    from .remote import RemoteReward

    for cls in (
        JpegCompressibility,
        JpegIncompressibility,
        HPSv2Reward,
        CLIPScoreReward,
        AestheticReward,
        PickScoreReward,
        ImageRewardReward,
        RemoteReward,
    ):
        register(cls)
