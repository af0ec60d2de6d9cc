"""The chain sampler core shared by DanceGRPO, MixGRPO and DDPO, and the chain topology helper.

All three algorithms draw ``samples_per_group`` independent denoising chains per prompt group; they differ only in a
*per-step plan*: which step kernel runs at each schedule index (SDE, ODE, DPM-Solver++), which edges may be trained
(every step, a per-sample random subset, a sliding window) and whether a group shares its initial noise. This module
runs such a plan batched over every chain of the batch and records one node per chain per noise level and one edge per
transition with :class:`~rlpost.ops.sampling.RolloutBuilder`. The plans restate ``XueZeyue/DanceGRPO``
``fastvideo/train_grpo_flux.py``@15cc71d, ``yifan123/flow_grpo`` ``scripts/train_sd3_fast.py``@74db691 (random SDE
window) and ``Tencent-Hunyuan/MixGRPO`` ``fastvideo/utils/grpo_states.py``@e5cdd6a (sliding window).

A chain rollout is a forest in which every node has at most one child, so advantage estimators recover "which sample
does this edge lead to" from the edge table alone (:func:`edge_sample_ids`), without a sampler-private side table.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from rlpost.core.api import EDGE_OLD_MEANS, Policy, StepCounts
from rlpost.core.contract import PromptBatch, Rollout
from rlpost.ops.dpm_solver import dpm_solver_pp2_step
from rlpost.ops.kernels import LogProbReduction, StepKernel
from rlpost.ops.sampling import RolloutBuilder, frontier_velocity

__all__ = [
    "DPM_SOLVER",
    "ChainPlan",
    "broadcast_to_edges",
    "chain_counts",
    "edge_sample_ids",
    "last_steps_kernels",
    "last_steps_problems",
    "node_sample_ids",
    "random_step_subset",
    "rollout_chains",
    "run_chains",
    "shared_or_independent_noise",
]

DPM_SOLVER = "dpm-solver++2"
"""Kernel name recorded for deterministic multistep DPM-Solver++ (2M) edges (MixGRPO-Flash's compressed tail)."""


@dataclass(frozen=True)
class ChainPlan:
    """What to do at each of the ``T`` steps of every chain.

    Attributes:
        sigmas: ``[T + 1]`` noise levels from 1 to 0 (may hold a compressed tail, see MixGRPO-Flash).
        kernel_names: Names of the kernels referenced by ``step_kernel`` (recorded as ``Rollout.kernels``).
        kernels: Kernel objects aligned with ``kernel_names``; ``None`` for the DPM-Solver++ entry.
        step_kernel: ``T`` indices into ``kernels``, one per step.
        trainable: ``[S, T]`` bool, which edge of which chain the update rule may train. Only stochastic steps may be
            trainable (a deterministic edge has no density).
        decode_x0: Decode the clean estimate ``x̂0 = x - σ_{T-1}·v`` predicted at the last step instead of the final
            state (DanceGRPO's decoded image, ``XueZeyue/DanceGRPO`` ``fastvideo/train_grpo_flux.py``@15cc71d
            ``run_sample_step``), so a sampled last step leaves no noise in the image.
    """

    sigmas: Tensor
    kernel_names: list[str]
    kernels: list[StepKernel | None]
    step_kernel: list[int]
    trainable: Tensor
    decode_x0: bool = False

    def __post_init__(self) -> None:
        t = len(self.step_kernel)
        if self.sigmas.shape != (t + 1,):
            raise ValueError(f"ChainPlan: {t} steps need {t + 1} sigmas, got {tuple(self.sigmas.shape)}")
        if self.trainable.ndim != 2 or self.trainable.shape[1] != t:
            raise ValueError(f"ChainPlan: trainable must be [S, {t}], got {tuple(self.trainable.shape)}")
        if len(self.kernels) != len(self.kernel_names):
            raise ValueError("ChainPlan: kernels and kernel_names differ in length")
        for i, k in enumerate(self.step_kernel):
            kernel = self.kernels[k]
            if bool(self.trainable[:, i].any()) and (kernel is None or not kernel.stochastic):
                raise ValueError(
                    f"ChainPlan: step {i} uses deterministic kernel {self.kernel_names[k]!r} but is trainable"
                )

    @property
    def num_steps(self) -> int:
        """Number of steps ``T``."""
        return len(self.step_kernel)


def shared_or_independent_noise(
    policy: Policy,
    num_groups: int,
    samples_per_group: int,
    generator: torch.Generator | Sequence[torch.Generator],
    shared: bool,
) -> Tensor:
    """Initial noise for ``G·K`` chains, group-major: one draw per group repeated ``K`` times when ``shared``
    (DanceGRPO's ``--init_same_noise``, ``fastvideo/train_grpo_flux.py``@15cc71d), else one draw per chain. With one
    generator per group, group ``j``'s rows are what a one-group call with ``generator[j]`` draws.

    Raises:
        ValueError: When a list of generators does not hold one per group.
    """
    if not isinstance(generator, torch.Generator):
        _check_generators(generator, num_groups)
        return torch.cat([shared_or_independent_noise(policy, 1, samples_per_group, g, shared) for g in generator])
    if shared:
        return policy.initial_noise(num_groups, generator).repeat_interleave(samples_per_group, dim=0)
    return policy.initial_noise(num_groups * samples_per_group, generator)


def last_steps_kernels(num_steps: int, penultimate_step: str, final_step: str) -> list[int]:
    """Kernel index per step for chain samplers with an SDE (index 0) and an Euler ODE (index 1): SDE everywhere
    except the last two steps, each ``"ode"`` or ``"sde"`` as configured (the step into the grid's last nonzero level
    and the step to 0; docs/models.md "Time grids" says why they are deterministic by default)."""
    kinds = [0] * num_steps
    if penultimate_step == "ode" and num_steps >= 2:
        kinds[-2] = 1
    if final_step == "ode":
        kinds[-1] = 1
    return kinds


def last_steps_problems(penultimate_step: str, final_step: str) -> list[str]:
    """Validation messages for the two settings :func:`last_steps_kernels` reads (each ``"ode"`` or ``"sde"``),
    prefixed by their recipe field (``sampler.init_args.final_step``, ``sampler.init_args.penultimate_step``)."""
    return [
        f"sampler.init_args.{field}: must be 'ode' or 'sde', got {value!r}"
        for field, value in (("final_step", final_step), ("penultimate_step", penultimate_step))
        if value not in ("ode", "sde")
    ]


def random_step_subset(
    num_samples: int, num_steps: int, eligible: int, num_train: int, generator: torch.Generator
) -> Tensor:
    """``[S, T]`` bool: each sample trains ``num_train`` of the first ``eligible`` steps, its own random choice.

    Restates DDPO/DanceGRPO's per-sample timestep subset (``timestep_fraction`` in ``kvablack/ddpo-pytorch``
    ``scripts/train.py``@1958463 and ``XueZeyue/DanceGRPO`` ``fastvideo/train_grpo_flux.py``@15cc71d): every sample
    draws a random permutation of its eligible steps and keeps the first ``num_train``. Drawn from ``generator``.
    """
    order = torch.rand((num_samples, eligible), generator=generator).argsort(dim=1)[:, :num_train]
    trainable = torch.zeros((num_samples, num_steps), dtype=torch.bool)
    return trainable.scatter_(1, order, True)


def run_chains(
    policy: Policy,
    batch: PromptBatch,
    generator: torch.Generator | Sequence[torch.Generator],
    plan: ChainPlan,
    noise: Tensor,
    chunk_size: int,
    reduction: LogProbReduction = "mean",
    record_means: bool = False,
) -> Rollout:
    """Run ``S = G·K`` chains through ``plan``, batched across all chains (forwards chunked by ``chunk_size`` rows).

    Chains are group-major: chain ``s`` belongs to group ``s // K``. SDE noise is drawn from ``generator`` on its own
    device and moved to the policy device, so a CPU generator drives a CUDA rollout reproducibly.

    Args:
        policy: The policy (already set up).
        batch: Prompt groups; ``batch.samples_per_group`` chains each.
        generator: RNG for the step noise: one for the batch, or one per group (group ``j``'s ``K`` rows of every
            step drawn from ``generator[j]``, what a one-group run with it draws: :func:`rollout_chains`).
        plan: Per-step kernels and trainable flags (``plan.trainable`` has ``S`` rows).
        noise: ``[S, *latent_shape]`` initial states.
        chunk_size: Maximum rows per denoiser forward and per VAE decode.
        reduction: Log-prob reduction of stochastic kernels.
        record_means: Also record every edge's step mean in ``Rollout.edge_extras[EDGE_OLD_MEANS]`` (the
            ``edge-old-means`` capability; a deterministic step's mean is its next state). Off: nothing extra.

    Returns:
        The rollout; ``stats["perf/rollout_forwards"]`` counts denoiser rows (before CFG doubling).
    """
    g, k = batch.num_groups, batch.samples_per_group
    s = g * k
    if noise.shape[0] != s or plan.trainable.shape[0] != s:
        raise ValueError(
            f"run_chains: {s} chains but noise has {noise.shape[0]} rows and the plan {plan.trainable.shape[0]}"
        )
    _check_generators(generator, g)
    device = policy.device
    groups = torch.arange(g).repeat_interleave(k)
    cond = policy.encode(batch.prompts)
    sigmas = plan.sigmas.to(torch.float32)
    builder = RolloutBuilder(batch, sigmas, plan.kernel_names)
    x = noise.to(device, torch.float32)
    node = builder.add_nodes(x, 0, groups)
    forwards = 0
    prev_sigma: Tensor | None = None
    prev_x0: Tensor | None = None
    last_x0: Tensor | None = None
    for i in range(plan.num_steps):
        sigma = sigmas[i].expand(s).to(device)
        sigma_next = sigmas[i + 1].expand(s).to(device)
        v = frontier_velocity(policy, x, sigma, cond, groups, chunk_size)
        forwards += s
        if plan.decode_x0 and i == plan.num_steps - 1:
            last_x0 = x - sigmas[i].to(device) * v
        kernel_index = plan.step_kernel[i]
        kernel = plan.kernels[kernel_index]
        if kernel is None:
            # Multistep DPM-Solver++ (2M): order 2 from the second step of the tail on
            # (Tencent-Hunyuan/MixGRPO fastvideo/utils/sampling_utils.py@e5cdd6a).
            x_next, x0 = dpm_solver_pp2_step(x, v, sigma, sigma_next, prev_sigma, prev_x0)
            prev_sigma, prev_x0 = sigma, x0
            log_prob = torch.full((s,), math.nan)
            mean = x_next
        else:
            prev_sigma, prev_x0 = None, None
            z = None
            if kernel.stochastic:
                z = _step_noise(x.shape, generator, k).to(device, torch.float32)
            out = kernel.step(x, v, sigma, sigma_next, generator=None, reduction=reduction, noise=z)
            x_next, log_prob, mean = out.next_latents, out.log_prob, out.mean
        child = builder.add_nodes(x_next, i + 1, groups)
        flags = plan.trainable[:, i]
        for flag in (True, False):
            rows = (flags == flag).nonzero().flatten()
            if rows.numel():
                extras = {EDGE_OLD_MEANS: mean[rows.to(mean.device)]} if record_means else None
                lp = log_prob[rows.to(log_prob.device)]
                builder.add_edges(node[rows], child[rows], lp, flag, kernel_index, extras)
        x, node = x_next, child
    decoded = x if last_x0 is None else last_x0
    media = torch.cat([policy.decode(decoded[j : j + chunk_size]) for j in range(0, s, chunk_size)])
    return builder.build(node, media, stats={"perf/rollout_forwards": float(forwards)})


def rollout_chains(
    policy: Policy,
    batch: PromptBatch,
    generator: torch.Generator | Sequence[torch.Generator],
    num_steps: int,
    plan: Callable[[Tensor, int, torch.Generator], ChainPlan],
    shared_noise: bool,
    chunk_size: int,
    reduction: LogProbReduction,
    record_means: bool = False,
) -> Rollout:
    """One rollout of ``G·K`` independent chains of ``num_steps`` steps (DanceGRPO, DDPO): initial noise first (see
    :func:`shared_or_independent_noise`), then ``plan(sigmas, G·K, generator)``, then :func:`run_chains`. The draw
    order from ``generator`` is fixed: noise, then whatever ``plan`` draws, then the chains' step noise.

    With one generator per group (``Sampler.rollout_groups``), group ``j`` draws from ``generator[j]`` exactly what a
    rollout of that group alone draws, in the same order (its noise, its ``K`` plan rows, its ``K`` rows of each
    step's noise); the forwards still run over all groups at once, so the result equals one rollout per group up to
    floating-point batch effects and the order of edge rows, with ``G`` times fewer transformer calls.
    ``record_means`` is :func:`run_chains`'.

    Raises:
        ValueError: When a list of generators does not hold one per group.
    """
    k = batch.samples_per_group
    noise = shared_or_independent_noise(policy, batch.num_groups, k, generator, shared_noise)
    sigmas = policy.sigmas(num_steps)
    if isinstance(generator, torch.Generator):
        chains = plan(sigmas, batch.num_groups * k, generator)
    else:
        plans = [plan(sigmas, k, g) for g in generator]
        chains = replace(plans[0], trainable=torch.cat([p.trainable for p in plans]))
    return run_chains(policy, batch, generator, chains, noise, chunk_size, reduction, record_means)


def _check_generators(generator: torch.Generator | Sequence[torch.Generator], num_groups: int) -> None:
    if not isinstance(generator, torch.Generator) and len(generator) != num_groups:
        raise ValueError(f"{num_groups} groups but {len(generator)} generators (one per group)")


def _step_noise(shape: torch.Size, generator: torch.Generator | Sequence[torch.Generator], per_group: int) -> Tensor:
    """One step's standard normals: from one generator, or group-major blocks of ``per_group`` rows per generator."""
    if isinstance(generator, torch.Generator):
        return torch.randn(shape, generator=generator, device=generator.device)
    rows = (per_group, *shape[1:])
    return torch.cat([torch.randn(rows, generator=gen, device=gen.device) for gen in generator])


def chain_counts(num_groups: int, samples_per_group: int, num_steps: int, train_steps: int) -> StepCounts:
    """Counts of one step of :func:`rollout_chains`: ``S = G·K`` images, ``S·T`` rollout forwards and
    ``S·train_steps`` trained edges, each one training forward."""
    s = num_groups * samples_per_group
    edges = s * train_steps
    return StepCounts(images=s, trainable_edges=edges, rollout_forwards=s * num_steps, train_forwards=edges)


def node_sample_ids(rollout: Rollout) -> Tensor:
    """``[N]`` index of the sample each node leads to (``-1`` for nodes that lead to no decoded sample).

    Walks the edge table from every decoded node back to its root, all samples at once (one vectorised hop per
    step). Requires chain topology: each node has at most one child.

    Raises:
        ValueError: When some node has several children (a tree: the sample of an inner node is ambiguous).
    """
    if rollout.is_branching():
        raise ValueError("node_sample_ids: the rollout branches (a tree); per-sample advantages need chains")
    parent = torch.full((rollout.num_nodes,), -1, dtype=torch.long)
    parent[rollout.edge_child] = rollout.edge_parent
    ids = torch.full((rollout.num_nodes,), -1, dtype=torch.long)
    cur = rollout.sample_node.clone()
    owner = torch.arange(rollout.num_samples)
    while cur.numel():
        ids[cur] = owner
        up = parent[cur]
        keep = up >= 0
        cur, owner = up[keep], owner[keep]
    return ids


def edge_sample_ids(rollout: Rollout) -> Tensor:
    """``[E]`` index of the sample each edge leads to (``-1`` when its child reaches no decoded sample)."""
    return node_sample_ids(rollout)[rollout.edge_child]


def broadcast_to_edges(rollout: Rollout, sample_values: Tensor) -> Tensor:
    """Give every trainable edge the value of the sample its chain ends in; other edges get 0.

    Args:
        rollout: A chain rollout.
        sample_values: ``[S]`` per-sample values (advantages).

    Returns:
        ``[E]`` fp32 per-edge values.
    """
    owner = edge_sample_ids(rollout)
    values = torch.zeros(rollout.num_edges, dtype=torch.float32)
    mask = rollout.trainable & (owner >= 0)
    values[mask] = sample_values.float().cpu()[owner[mask]]
    return values
