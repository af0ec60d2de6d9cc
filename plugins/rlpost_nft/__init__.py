"""DiffusionNFT for rlpost: the likelihood-free update rule ``nft`` (implicit positive/negative flow-matching loss on
re-noised clean samples, rollouts under a lagging "old" weight copy).

Registered through the ``rlpost`` entry-point group (``nft = "rlpost_nft"``). See ``docs/algorithms/nft.md``.
"""

from __future__ import annotations

from rlpost import PolicyOptimizer, Registry, hookimpl


@hookimpl
def rlpost_register_optimizers(register: Registry[PolicyOptimizer]) -> None:
    """Register :class:`~rlpost_nft.update.NFTUpdate` (``nft``)."""
    from .update import NFTUpdate

    register(NFTUpdate)
