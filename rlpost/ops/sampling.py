"""Helpers every sampler shares: building the node/edge table, chunked frontier forwards, and recomputing edge
log-probs with one denoiser forward per parent node.

Samplers differ in *which* steps branch, which kernel each step uses and which edges are trainable; the
bookkeeping below is the same for all of them, so it lives here once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from rlpost.core.api import Conditioning, EdgeEval, Policy
from rlpost.core.contract import PromptBatch, Rollout
from rlpost.ops.kernels import LogProbReduction, StepKernel

__all__ = ["RolloutBuilder", "evaluate_edges", "frontier_velocity"]


class RolloutBuilder:
    """Accumulates nodes and edges during a rollout, then assembles a :class:`~rlpost.core.contract.Rollout`.

    Args:
        batch: The step's prompt batch.
        sigmas: ``[T + 1]`` schedule used by the rollout.
        kernels: Names of the kernels edges may reference (index = ``kernel`` argument of :meth:`add_edges`).
    """

    def __init__(self, batch: PromptBatch, sigmas: Tensor, kernels: Sequence[str]) -> None:
        self.batch = batch
        self.sigmas = sigmas.detach().float().cpu()
        self.kernels = list(kernels)
        self._states: list[Tensor] = []
        self._steps: list[Tensor] = []
        self._groups: list[Tensor] = []
        self._edges: list[tuple[Tensor, Tensor, Tensor, Tensor, Tensor]] = []
        self._extras: dict[str, list[Tensor]] = {}
        self._count = 0

    def add_nodes(self, states: Tensor, step: int, groups: Tensor) -> Tensor:
        """Record ``B`` nodes at schedule index ``step``; returns their ``[B]`` node ids."""
        b = states.shape[0]
        ids = torch.arange(self._count, self._count + b)
        self._count += b
        self._states.append(states.detach().float().cpu())
        self._steps.append(torch.full((b,), step, dtype=torch.long))
        self._groups.append(groups.detach().long().cpu())
        return ids

    def add_edges(
        self,
        parent: Tensor,
        child: Tensor,
        log_prob: Tensor,
        trainable: bool,
        kernel: int,
        extras: dict[str, Tensor] | None = None,
    ) -> None:
        """Record ``B`` edges ``parent[i] -> child[i]`` produced by kernel index ``kernel``.

        ``extras`` are optional per-edge tensors (``B`` rows each, stored fp32 on the CPU) that become
        ``Rollout.edge_extras``; every call of one rollout must pass the same names (or none at all).
        """
        b = parent.shape[0]
        names = sorted(extras or {})
        if self._edges and names != sorted(self._extras):
            earlier = sorted(self._extras)
            raise ValueError(f"RolloutBuilder.add_edges: extras {names} differ from earlier edges' {earlier}")
        for name in names:
            assert extras is not None
            value = extras[name]
            if int(value.shape[0]) != b:
                rows = int(value.shape[0])
                raise ValueError(f"RolloutBuilder.add_edges: extra {name!r} has {rows} rows, expected {b}")
            self._extras.setdefault(name, []).append(value.detach().float().cpu())
        self._edges.append(
            (
                parent.long().cpu(),
                child.long().cpu(),
                log_prob.detach().double().cpu(),
                torch.full((b,), trainable, dtype=torch.bool),
                torch.full((b,), kernel, dtype=torch.long),
            )
        )

    def build(self, sample_nodes: Tensor, media: Tensor, stats: dict[str, float] | None = None) -> Rollout:
        """Assemble the rollout; ``sample_nodes`` are the decoded nodes, ``media`` their ``[S, F, H, W, 3]`` uint8
        (:meth:`Policy.decode`'s output)."""
        states = torch.cat(self._states)
        node_group = torch.cat(self._groups)
        cols = [torch.cat(c) if c else torch.zeros(0) for c in zip(*self._edges, strict=True)] if self._edges else []
        if not cols:
            empty = torch.zeros(0, dtype=torch.long)
            cols = [empty, empty, torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.bool), empty]
        sample_nodes = sample_nodes.long().cpu()
        return Rollout(
            prompts=list(self.batch.prompts),
            metadata=[dict(m) for m in self.batch.metadata],
            sigmas=self.sigmas,
            states=states,
            node_step=torch.cat(self._steps),
            node_group=node_group,
            edge_parent=cols[0],
            edge_child=cols[1],
            old_log_probs=cols[2],
            trainable=cols[3],
            edge_kernel=cols[4],
            kernels=self.kernels,
            sample_node=sample_nodes,
            sample_group=node_group[sample_nodes],
            media=media.detach().cpu(),
            group_offset=self.batch.group_offset,
            stats=dict(stats or {}),
            edge_extras={name: torch.cat(parts) for name, parts in self._extras.items()},
        )


def frontier_velocity(
    policy: Policy, states: Tensor, sigma: Tensor, cond: Conditioning, rows: Tensor, chunk_size: int
) -> Tensor:
    """Velocity for a whole frontier in batched forwards of at most ``chunk_size`` rows (memory budget).

    Args:
        policy: The policy.
        states: ``[B, ...]`` states.
        sigma: ``[B]`` noise levels.
        cond: Conditioning with one row per prompt group.
        rows: ``[B]`` prompt-group row of each state.
        chunk_size: Maximum rows per forward.
    """
    outs = []
    for start in range(0, states.shape[0], chunk_size):
        sl = slice(start, start + chunk_size)
        outs.append(policy.velocity(states[sl].to(policy.device), sigma[sl], cond.select(rows[sl])))
    return torch.cat(outs)


def evaluate_edges(
    policy: Policy,
    rollout: Rollout,
    edges: Tensor,
    kernels: Sequence[StepKernel | None],
    reduction: LogProbReduction,
) -> EdgeEval:
    """Recompute the step Gaussian and log-prob of ``edges`` under the current policy, with gradients.

    One denoiser forward per unique parent node serves all of that parent's child edges (the TreeGRPO paper's
    amortised update); the log-prob is computed by the kernel's own :meth:`StepKernel.log_prob`, the function the
    rollout used, so an unchanged policy reproduces ``old_log_probs`` exactly.

    Args:
        policy: The policy (its trainable parameters receive gradients).
        rollout: The rollout holding the edges.
        edges: ``[B]`` edge indices.
        kernels: Kernel objects aligned with ``rollout.kernels``; ``None`` for kernels whose edges are never
            evaluated (e.g. MixGRPO-Flash's DPM-Solver++ tail).
        reduction: Log-prob reduction used at rollout.

    Raises:
        ValueError: When an edge was produced by a deterministic kernel (it has no log-prob to recompute).
    """
    for k in torch.unique(rollout.edge_kernel[edges]).tolist():
        kernel = kernels[k]
        if kernel is None or not kernel.stochastic:
            raise ValueError(f"cannot evaluate edges of deterministic kernel {rollout.kernels[k]!r}")
    parents, inverse = rollout.parents_of(edges)
    device = policy.device
    x = rollout.states[parents].to(device)
    step = rollout.node_step[parents]
    sigma = rollout.sigmas[step].to(device)
    sigma_next = rollout.sigmas[step + 1].to(device)
    cond = policy.encode(rollout.prompts).select(rollout.node_group[parents])
    v = policy.velocity(x, sigma, cond)
    parent_kernel = torch.zeros(parents.shape[0], dtype=torch.long)
    parent_kernel[inverse] = rollout.edge_kernel[edges]
    mean = torch.empty_like(v)
    std = torch.empty((v.shape[0],) + (1,) * (v.ndim - 1), dtype=torch.float32, device=device)
    for k in torch.unique(parent_kernel).tolist():
        sel = (parent_kernel == k).nonzero().flatten().to(device)
        m, s = _stochastic(kernels[k]).mean_std(x[sel], v[sel], sigma[sel], sigma_next[sel])
        mean = mean.index_copy(0, sel, m)
        std = std.index_copy(0, sel, s.expand(sel.shape[0], *std.shape[1:]).to(torch.float32))
    child = rollout.states[rollout.edge_child[edges]].to(device)
    inv = inverse.to(device)
    edge_kernel = rollout.edge_kernel[edges]
    log_prob = torch.empty(edges.shape[0], dtype=torch.float64, device=device)
    for k in torch.unique(edge_kernel).tolist():
        sel = (edge_kernel == k).nonzero().flatten().to(device)
        lp = _stochastic(kernels[k]).log_prob(child[sel], mean[inv[sel]], std[inv[sel]], reduction)
        log_prob = log_prob.index_copy(0, sel, lp)
    return EdgeEval(log_prob=log_prob, mean=mean[inv], std=std[inv], forwards=int(parents.shape[0]))


def _stochastic(kernel: StepKernel | None) -> StepKernel:
    assert kernel is not None  # checked at the top of evaluate_edges
    return kernel
