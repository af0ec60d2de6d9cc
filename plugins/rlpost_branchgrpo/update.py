"""BranchGRPO's update rule: the clipped surrogate with upstream's per-tree loss scale.

Upstream (``Fredreic1849/BranchGRPO`` ``fastvideo/train_branchgrpo_flux.py``@19fbb9f L1486-1596) shuffles the
rank's trained edges, and for each edge backpropagates
``max(-A·ratio, -A·clip(ratio, 1-ε, 1+ε)) / (gradient_accumulation_steps · E_tree)`` with ``A`` clipped to
``±adv_clip_max`` and ``E_tree = ⌊edges on the rank / trees on the rank⌋`` (L1486-1489), stepping the optimizer every
``gradient_accumulation_steps`` edges; no KL, no reference model.

The built-in :class:`rlpost.ClippedSurrogate` already divides each optimizer step's summed loss by its edge count
(``loss_normalisation: edge``, the ``gradient_accumulation_steps`` edges of the step, summed over ranks as the
data-parallel gradient average does) and cuts the shuffled edges into steps (``units_per_step``); this subclass adds
the remaining factor ``1 / E_tree`` through :meth:`ClippedSurrogate.surrogate_weight`.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from rlpost import ClippedSurrogate, EdgeEval, Rollout, UpdateContext

__all__ = ["BranchSurrogate", "edges_per_tree"]


def edges_per_tree(rollout: Rollout) -> int:
    """``max(1, ⌊trainable edges / trees⌋)`` of a rollout (upstream's ``avg_samples_per_tree``, per rank); a tree is
    a root node (a node no edge leads to)."""
    has_parent = torch.zeros(rollout.num_nodes, dtype=torch.bool)
    has_parent[rollout.edge_child] = True
    trees = max(1, int((~has_parent).sum()))
    return max(1, int(rollout.trainable.sum()) // trees)


class BranchSurrogate(ClippedSurrogate):
    """:class:`rlpost.ClippedSurrogate` with every edge's surrogate divided by the trained edges per tree.

    Takes the built-in rule's arguments (``clip_range``, ``adv_clip_max``, ``units_per_step`` ...); the defaults
    here are upstream's layout: shuffled parent units, per-edge mean within an optimizer step, no KL.
    """

    name: ClassVar[str] = "branch-surrogate"

    def surrogate_weight(self, ctx: UpdateContext, mb: Tensor, evaluation: EdgeEval) -> Tensor | float:
        """``1 / E_tree`` for every edge of the rank's rollout (upstream's ``num_samples_per_step``, L1486-1489)."""
        return 1.0 / edges_per_tree(ctx.rollout)
