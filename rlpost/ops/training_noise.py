"""Timesteps and noise that a likelihood-free update rule draws for itself, reproducible under resume and on any
number of ranks.

A likelihood-free rule (DiffusionNFT, AWM, DGPO) re-noises each clean sample ``x0`` to ``x_σ = (1-σ)·x0 + σ·ε`` at
noise levels it picks. Every draw here comes from a generator keyed by values that do not depend on which rank holds a
sample (:func:`keyed_generator`: the run seed, the step, a global group index, the sample's place in its group), so a
run on 1 or 8 ranks, or resumed from a checkpoint, draws the same ``σ`` and ``ε`` for the same sample. Draws shared by
the whole step (DGPO's timestep subset, the same on every rank) key on the step alone.

The three upstream schemes:

* :func:`grid_permutations`: per sample an independent random permutation of the rollout grid's step indices, of which
  the first ``keep`` are trained (NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py`` @24af555 L810-816);
* :func:`stratified_indices`: ``n`` strata over a range of step indices, one index drawn uniformly in each
  (scxue/advantage_weighted_matching ``advantage_weighted_matching/scripts/train_sd3_awm.py`` @be51372 L1172-1205,
  ``time_type="discrete"`` and ``"discrete_wo_init"``);
* :func:`subset_without_replacement`: ``n`` step indices drawn without replacement from ``0 … hi`` (Luo-Yihong/DGPO
  ``scripts/train_sd3_dgpo.py`` @01ceb4b L52-108).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from rlpost.core.contract import Rollout

__all__ = [
    "NOISE_STREAM",
    "grid_permutations",
    "keyed_generator",
    "noise_for",
    "renoise",
    "sample_keys",
    "stratified_indices",
    "subset_without_replacement",
]

NOISE_STREAM = 7
"""Stream id mixed into every key here, so these draws never coincide with the engine's rollout or minibatch streams
(``rlpost/engine/sharding.py`` uses 1-4)."""


def keyed_generator(seed: int, *keys: int) -> torch.Generator:
    """A CPU generator seeded from ``(seed, keys...)`` through NumPy's ``SeedSequence`` (well mixed: neighbouring keys
    get unrelated streams). The same keys give the same draws in any process."""
    entropy = np.random.SeedSequence([seed % 2**63, NOISE_STREAM, *(int(k) for k in keys)])
    words = entropy.generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(words[0]) << 32 | int(words[1]))


def sample_keys(rollout: Rollout) -> list[tuple[int, int]]:
    """``(global group, place in group)`` of each sample of ``rollout``: the same for a sample whichever rank holds
    its group (ranks hold whole groups, ``rlpost/engine/sharding.py``)."""
    seen: dict[int, int] = {}
    keys = []
    for g in rollout.sample_group.tolist():
        place = seen.get(g, 0)
        seen[g] = place + 1
        keys.append((rollout.group_offset + int(g), place))
    return keys


def grid_permutations(seed: int, step: int, keys: Sequence[tuple[int, int]], num_steps: int, keep: int) -> Tensor:
    """``[S, keep]`` long: per sample the first ``keep`` entries of a random permutation of ``0 … num_steps-1``."""
    if not 1 <= keep <= num_steps:
        raise ValueError(f"keep must be in [1, {num_steps}], got {keep}")
    rows = [torch.randperm(num_steps, generator=keyed_generator(seed, step, 0, g, i))[:keep] for g, i in keys]
    return torch.stack(rows) if rows else torch.empty(0, keep, dtype=torch.long)


def stratified_indices(generator: torch.Generator, lo: int, hi: int, n: int) -> Tensor:
    """``[n]`` long: one index drawn uniformly in each of ``n`` strata of ``lo … hi``, AWM's discrete law.

    With boundaries ``b = linspace(lo, hi, n+1)``, stratum ``i`` holds the integers ``⌊b_i⌋ … ⌊b_{i+1}⌋ - 1`` (just
    ``⌊b_i⌋`` when both floors are equal), so ``hi`` itself is never drawn and short ranges repeat an index: for
    ``lo=1, hi=12, n=6`` the strata are ``{1}, {2,3}, {4,5}, {6,7}, {8,9}, {10,11}``
    (scxue/advantage_weighted_matching ``advantage_weighted_matching/scripts/train_sd3_awm.py`` @be51372 L1172-1180
    and L1197-1205: truncated boundaries plus a truncated uniform offset). The boundaries are computed in fp64;
    upstream's fp32 ones truncate to the same integers for the grids its presets use.
    """
    if n < 1 or hi < lo:
        raise ValueError(f"stratified_indices: need n >= 1 and hi >= lo, got n={n}, lo={lo}, hi={hi}")
    bounds = torch.linspace(float(lo), float(hi), n + 1, dtype=torch.float64).floor().long()
    lower, width = bounds[:-1], bounds[1:] - bounds[:-1]
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    return lower + (u * width).floor().long()


def subset_without_replacement(generator: torch.Generator, hi: int, n: int) -> Tensor:
    """``[n]`` long: ``n`` distinct indices of ``0 … hi``, in the order drawn."""
    if not 1 <= n <= hi + 1:
        raise ValueError(f"subset_without_replacement: need 1 <= n <= {hi + 1}, got {n}")
    return torch.randperm(hi + 1, generator=generator)[:n]


def noise_for(seed: int, step: int, key: Sequence[int], shape: Sequence[int], index: int = 0) -> Tensor:
    """``ε ~ N(0, I)`` of ``shape`` (fp32, CPU) keyed by ``(seed, step, key..., index)``: pass a sample's
    :func:`sample_keys` entry for per-sample noise, or ``(global group,)`` for noise a whole group shares (DGPO)."""
    return torch.randn(tuple(shape), generator=keyed_generator(seed, step, 1, index, *key))


def renoise(x0: Tensor, sigma: Tensor, noise: Tensor) -> Tensor:
    """``x_σ = (1-σ)·x0 + σ·ε`` (rectified flow), ``sigma`` ``[B]`` broadcast over the latent dimensions."""
    s = sigma.to(x0.dtype).reshape(-1, *([1] * (x0.ndim - 1)))
    return (1 - s) * x0 + s * noise.to(x0)
