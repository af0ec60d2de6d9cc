"""Branching a tree's frontier: ``k`` children of every node around the node's one step Gaussian.

A tree sampler evaluates the velocity of each frontier node **once** (one transformer row per node, batched over the
frontier by :func:`rlpost.ops.sampling.frontier_velocity`) and draws all ``k`` children from the same transition
``N(μ(x, v), s²I)`` (TreeGRPO, arXiv 2512.08153, Sec. "Method"; BranchGRPO, arXiv 2509.06040, Sec. 3.2;
TempFlow-GRPO, arXiv 2508.04324, Sec. 3.1). Children of one parent are adjacent rows, parents in frontier order.
"""

from __future__ import annotations

from torch import Tensor

from rlpost.ops.kernels import LogProbReduction, StepKernel, StepOutput

__all__ = ["branch_children"]


def branch_children(
    kernel: StepKernel,
    x: Tensor,
    v: Tensor,
    sigma: Tensor,
    sigma_next: Tensor,
    k: int,
    noise: Tensor,
    reduction: LogProbReduction = "mean",
) -> StepOutput:
    """Draw ``k`` children of every row of ``x`` with ``kernel`` and score each under its parent's step Gaussian.

    Args:
        kernel: A stochastic step kernel.
        x: ``[F, ...]`` frontier states at ``sigma``.
        v: ``[F, ...]`` their velocities (one evaluation per node, guidance applied).
        sigma: ``[F]`` current noise levels.
        sigma_next: ``[F]`` next noise levels.
        k: Children per node.
        noise: ``[F·k, ...]`` standard normals, children of a parent adjacent. A sampler that spreads its children
            wider than the density it scores them under (BranchGRPO's ``split_noise_scale``) passes scaled noise.
        reduction: Log-prob reduction (see :func:`rlpost.ops.kernels.gaussian_log_prob`).

    Returns:
        The children's :class:`~rlpost.ops.kernels.StepOutput` (``[F·k]`` rows).

    Raises:
        ValueError: When the kernel is deterministic or ``noise`` has the wrong number of rows.
    """
    if not kernel.stochastic:
        raise ValueError(f"branch_children: kernel {kernel!r} is deterministic; children would all be equal")
    if noise.shape[0] != x.shape[0] * k:
        raise ValueError(f"branch_children: {x.shape[0]} nodes x {k} children need {x.shape[0] * k} noise rows")
    return kernel.step(
        x.repeat_interleave(k, 0),
        v.repeat_interleave(k, 0),
        sigma.repeat_interleave(k, 0),
        sigma_next.repeat_interleave(k, 0),
        None,
        reduction,
        noise=noise,
    )
