"""Capabilities: what a sampler's rollouts provide and what an advantage estimator or update rule requires of them.

Part of :mod:`rlpost.core.api` (the package re-exports every name).

Diffusion RL has two families of update rule. Policy-gradient rules (the clipped surrogate of TreeGRPO, DanceGRPO,
MixGRPO, DDPO, Flow-GRPO) need the log-probability of each stochastic denoising edge, recorded at rollout and
recomputed under the current policy (:meth:`~rlpost.core.api.Sampler.evaluate`). Likelihood-free rules (DiffusionNFT,
arXiv 2509.16117; AWM, arXiv 2509.25050; DGPO, arXiv 2510.08425) need only the clean samples and their advantages:
they re-noise the samples themselves and train a flow-matching loss. A sampler declares what its rollouts give
(``provides``), the estimator and the rule what they need (``requires``), and ``rlpost validate`` refuses a recipe
whose sampler lacks something, before any weights load, naming the capability and both components.

The names are plain strings so third-party plugins can add their own; the ones rlpost itself defines are below.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

__all__ = [
    "CHAINS",
    "CLEAN_SAMPLES",
    "DEFAULT_UPDATE_REQUIRES",
    "EDGE_LOG_PROBS",
    "EDGE_OLD_MEANS",
    "KNOWN_CAPABILITIES",
    "TREE",
    "missing_capabilities",
]

EDGE_LOG_PROBS: Final = "edge-log-probs"
"""Rollouts record stochastic edges with behaviour log-probs (``Rollout.old_log_probs``, ``Rollout.trainable``) and
the sampler recomputes them under the current policy (:meth:`~rlpost.core.api.Sampler.evaluate`)."""

CLEAN_SAMPLES: Final = "clean-samples"
"""Each decoded sample's node holds its clean latent ``x0`` (``Rollout.states[Rollout.sample_node]``): what a
likelihood-free rule re-noises. Every sampler that ends its chains at noise level 0 provides it."""

CHAINS: Final = "chains"
"""Every sample has its own chain of edges (no shared nodes): per-sample advantages broadcast to a chain's edges."""

TREE: Final = "tree"
"""Samples share ancestors in a branching tree whose node table an estimator backs leaf rewards up through."""

EDGE_OLD_MEANS: Final = "edge-old-means"
"""Rollouts carry the behaviour policy's step mean of every edge, ``Rollout.edge_extras[EDGE_OLD_MEANS]``
(``[E, *latent_shape]`` fp32; for a deterministic edge its next state). GRPO-Guard's ratio normalisation
(arXiv 2510.22319) re-centres the log-ratio with it. Recording it costs one latent per edge, so samplers provide it
only when asked."""

KNOWN_CAPABILITIES: Final = frozenset({EDGE_LOG_PROBS, EDGE_OLD_MEANS, CLEAN_SAMPLES, CHAINS, TREE})
"""The capabilities rlpost defines (plugins may define more)."""

DEFAULT_UPDATE_REQUIRES: Final = frozenset({EDGE_LOG_PROBS})
"""What an update rule that declares nothing requires: edge log-probs, because before capabilities existed every
update rule was a policy-gradient rule calling :meth:`~rlpost.core.api.Sampler.evaluate`. A likelihood-free rule
declares ``requires = frozenset({CLEAN_SAMPLES})``."""


def missing_capabilities(provided: Iterable[str], required: Iterable[str]) -> list[str]:
    """The capabilities in ``required`` that ``provided`` lacks, sorted."""
    have = set(provided)
    return sorted(set(required) - have)
