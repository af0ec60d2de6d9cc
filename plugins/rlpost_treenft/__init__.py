"""TreeNFT for rlpost: DiffusionNFT's likelihood-free loss trained at the nodes of TreeGRPO's search tree, each node
regressed towards the clean samples below it, weighted by their optimality (update rule ``tree-nft``).

Registered through the ``rlpost`` entry-point group (``treenft = "rlpost_treenft"``). See
``docs/algorithms/treenft.md``.
"""

from __future__ import annotations

from rlpost import PolicyOptimizer, Registry, hookimpl


@hookimpl
def rlpost_register_optimizers(register: Registry[PolicyOptimizer]) -> None:
    """Register :class:`~rlpost_treenft.update.TreeNFTUpdate` (``tree-nft``)."""
    from .update import TreeNFTUpdate

    register(TreeNFTUpdate)
