"""Merge rollouts of disjoint prompt groups into one table (the sharded and batched rollout paths share it).

Lives in the core layer because :meth:`rlpost.core.api.Sampler.rollout_groups`' default merges per-group rollouts;
``rlpost/engine/sharding.py`` uses it to join rank-local pieces.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from rlpost.core.contract import Rollout

__all__ = ["merge_rollouts", "merge_stats"]


def merge_stats(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """Combine per-part rollout stats: ``perf/*`` counters add up, everything else is averaged."""
    keys = [k for k in parts[0] if all(k in p for p in parts)] if parts else []
    return {k: float(sum(p[k] for p in parts) / (1 if k.startswith("perf/") else len(parts))) for k in keys}


def merge_rollouts(parts: Sequence[Rollout]) -> Rollout:
    """Concatenate rollouts of disjoint node sets into one table.

    Groups are keyed by their global index ``part.group_offset + local group``: the merged rollout's
    ``group_offset`` is the smallest part offset, and two parts holding trees of the same global group share its
    group id. The stash is the first part's; stats follow :func:`merge_stats`.
    """
    if not parts:
        raise ValueError("merge_rollouts: nothing to merge")
    if len(parts) == 1:
        return parts[0]
    kernels = parts[0].kernels
    if any(p.kernels != kernels for p in parts):
        raise ValueError("merge_rollouts: parts use different kernel lists")
    extras = sorted(parts[0].edge_extras)
    if any(sorted(p.edge_extras) != extras for p in parts):
        raise ValueError("merge_rollouts: parts record different edge_extras")
    base = min(p.group_offset for p in parts)
    count = max(p.group_offset - base + p.num_groups for p in parts)
    prompts: list[str | None] = [None] * count
    metadata: list[dict[str, Any]] = [{} for _ in range(count)]
    node_off = 0
    cat: dict[str, list[Tensor]] = {
        k: []
        for k in (
            "states",
            "node_step",
            "node_group",
            "edge_parent",
            "edge_child",
            "old_log_probs",
            "trainable",
            "edge_kernel",
            "sample_node",
            "sample_group",
            "media",
        )
    }
    for p in parts:
        shift = p.group_offset - base
        for g in range(p.num_groups):
            prompts[shift + g], metadata[shift + g] = p.prompts[g], p.metadata[g]
        cat["states"].append(p.states)
        cat["node_step"].append(p.node_step)
        cat["node_group"].append(p.node_group + shift)
        cat["edge_parent"].append(p.edge_parent + node_off)
        cat["edge_child"].append(p.edge_child + node_off)
        cat["old_log_probs"].append(p.old_log_probs)
        cat["trainable"].append(p.trainable)
        cat["edge_kernel"].append(p.edge_kernel)
        cat["sample_node"].append(p.sample_node + node_off)
        cat["sample_group"].append(p.sample_group + shift)
        cat["media"].append(p.media)
        node_off += p.num_nodes
    return Rollout(
        prompts=[x if x is not None else "" for x in prompts],
        metadata=metadata,
        sigmas=parts[0].sigmas,
        kernels=list(kernels),
        group_offset=base,
        stash=parts[0].stash,
        stats=merge_stats([p.stats for p in parts]),
        edge_extras={name: torch.cat([p.edge_extras[name] for p in parts]) for name in extras},
        **{k: torch.cat(v) for k, v in cat.items()},
    )
