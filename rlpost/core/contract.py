"""The data contract between components: prompt batches, rollouts (a node/edge table) and reward scores.

Every sampler in rlpost, whether it draws independent chains (DDPO, DanceGRPO), chains with an SDE window
(MixGRPO) or a branching tree (TreeGRPO), produces the same thing: a table of **nodes** (latent states at a
schedule index) and a table of **edges** (one denoising transition from a parent node to a child node, with the
log-probability the behaviour policy gave the child). Which edges may be trained is a per-edge flag. A chain is a
tree in which every node has one child, so the tree topology needs no separate structure: it *is* the edge table.

Storing states once per node (rather than ``latents``/``next_latents`` per edge) halves memory for chains and lets
the optimizer rule evaluate the policy once per parent node for all of its children (the TreeGRPO paper's
amortised update), see :meth:`Rollout.parents_of`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor

__all__ = [
    "PromptBatch",
    "Rollout",
    "RewardScores",
    "Stash",
    "StashKey",
]

T = TypeVar("T")


class StashKey(Generic[T]):
    """A typed key for :class:`Stash`; plugins create one at module level (pytest's ``StashKey`` idea)."""

    __slots__ = ("name",)

    def __init__(self, name: str = "") -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"StashKey({self.name!r})"


class Stash:
    """Typed per-plugin extras attached to a rollout or run without adding attributes or colliding.

    Example:
        >>> WINDOW = StashKey[int]("window_start")
        >>> s = Stash(); s[WINDOW] = 3; s[WINDOW]
        3
    """

    def __init__(self) -> None:
        self._data: dict[StashKey[Any], Any] = {}

    def __setitem__(self, key: StashKey[T], value: T) -> None:
        self._data[key] = value

    def __getitem__(self, key: StashKey[T]) -> T:
        value: T = self._data[key]
        return value

    def get(self, key: StashKey[T], default: T) -> T:
        """Return the value for ``key`` or ``default``."""
        value: T = self._data.get(key, default)
        return value

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)


@dataclass(frozen=True)
class PromptBatch:
    """The prompts of one training step, already repeated into groups.

    Attributes:
        prompts: One entry per *group* (a unique prompt draw); length G.
        metadata: Per-group metadata dicts from the prompt source (e.g. the digit class); length G.
        samples_per_group: How many images the sampler should produce per group (chain samplers use it as the
            group size; tree samplers derive their leaf count from their own shape and may ignore it).
        group_offset: Global index of this batch's first group (non-zero on ranks > 0).
    """

    prompts: list[str]
    metadata: list[dict[str, Any]]
    samples_per_group: int
    group_offset: int = 0

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.metadata):
            raise ValueError(f"PromptBatch: {len(self.prompts)} prompts but {len(self.metadata)} metadata entries")
        if self.samples_per_group < 1:
            raise ValueError(f"PromptBatch.samples_per_group must be >= 1, got {self.samples_per_group}")

    @property
    def num_groups(self) -> int:
        """Number of prompt groups in the batch."""
        return len(self.prompts)


@dataclass
class Rollout:
    """Everything a sampler recorded in one step: nodes, edges, final samples and decoded images.

    Node table (``N`` rows):
        states: ``[N, *latent_shape]`` latent at each node (fp32 on the rollout device).
        node_step: ``[N]`` long, index into ``sigmas`` of the node's noise level (0 = initial noise).
        node_group: ``[N]`` long, the prompt group (row of ``prompts``) the node belongs to.

    Edge table (``E`` rows), one denoising transition ``parent -> child``:
        edge_parent, edge_child: ``[E]`` long node indices.
        old_log_probs: ``[E]`` fp64 log-prob of the child's state under the behaviour policy (reduced per the sampler's
            ``logprob_reduction``); NaN for edges a deterministic kernel produced.
        trainable: ``[E]`` bool, edges the optimizer rule may train (SDE edges in the window, a timestep subset ...).
        edge_kernel: ``[E]`` long, index into ``kernels`` naming the step kernel that produced the edge.
        edge_extras: Optional per-edge tensors by name, each with ``E`` rows (e.g. the behaviour step mean
            ``[E, *latent_shape]`` under the ``edge-old-means`` capability's name, which GRPO-Guard's ratio
            normalisation needs). Empty unless a sampler was asked to record one, so it costs nothing otherwise.

    Samples (``S`` rows), the media that were decoded and scored (leaves of trees, ends of chains):
        sample_node: ``[S]`` long, the node whose state was decoded.
        sample_group: ``[S]`` long, the prompt group of each sample.
        media: ``[S, F, H, W, 3]`` uint8, ``F`` decoded frames per sample (``F = 1`` for an image model: images are
            one-frame media, the same code path, not a branch). :meth:`frames` flattens them to ``[S·F, H, W, 3]``.

    Attributes:
        prompts: One prompt per group; ``metadata`` the matching metadata dicts.
        sigmas: ``[T + 1]`` noise-level schedule the rollout used.
        kernels: Names of the step kernels referenced by ``edge_kernel``.
        group_offset: Global index of group 0 (for multi-rank runs).
        stash: Typed plugin-private extras (e.g. the window start of a tree).
        stats: Counters the sampler wants reported (e.g. ``perf/rollout_forwards``).
    """

    prompts: list[str]
    metadata: list[dict[str, Any]]
    sigmas: Tensor
    states: Tensor
    node_step: Tensor
    node_group: Tensor
    edge_parent: Tensor
    edge_child: Tensor
    old_log_probs: Tensor
    trainable: Tensor
    edge_kernel: Tensor
    kernels: list[str]
    sample_node: Tensor
    sample_group: Tensor
    media: Tensor
    group_offset: int = 0
    stash: Stash = field(default_factory=Stash)
    stats: dict[str, float] = field(default_factory=dict)
    edge_extras: dict[str, Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ sizes
    @property
    def num_nodes(self) -> int:
        """Number of nodes ``N``."""
        return int(self.states.shape[0])

    @property
    def num_edges(self) -> int:
        """Number of edges ``E``."""
        return int(self.edge_parent.shape[0])

    @property
    def num_samples(self) -> int:
        """Number of decoded samples ``S``."""
        return int(self.sample_node.shape[0])

    @property
    def num_groups(self) -> int:
        """Number of prompt groups ``G``."""
        return len(self.prompts)

    @property
    def num_frames(self) -> int:
        """Frames ``F`` per decoded sample (1 for images)."""
        return int(self.media.shape[1])

    def frames(self) -> Tensor:
        """Every decoded frame as an image batch, ``[S·F, H, W, 3]`` uint8 (sample-major: sample ``i``'s frames are
        rows ``i·F`` to ``i·F + F - 1``); for ``F = 1`` exactly the ``S`` images."""
        return self.media.flatten(0, 1)

    @property
    def sample_prompts(self) -> list[str]:
        """The prompt of each sample, aligned with ``media``."""
        return [self.prompts[int(g)] for g in self.sample_group.tolist()]

    @property
    def sample_metadata(self) -> list[dict[str, Any]]:
        """The metadata of each sample, aligned with ``media``."""
        return [self.metadata[int(g)] for g in self.sample_group.tolist()]

    @property
    def edge_step(self) -> Tensor:
        """``[E]`` schedule index of each edge's parent (the step the transition starts from)."""
        return self.node_step[self.edge_parent]

    # ------------------------------------------------------------- topology
    def children_count(self) -> Tensor:
        """``[N]`` number of outgoing edges per node (1 on a chain, k on a branching node, 0 on a leaf)."""
        return torch.bincount(self.edge_parent, minlength=self.num_nodes)

    def is_branching(self) -> bool:
        """True when some node has more than one child, i.e. the rollout is a tree rather than chains."""
        return bool((self.children_count() > 1).any())

    def parents_of(self, edges: Tensor) -> tuple[Tensor, Tensor]:
        """Group edges by parent node so the policy is evaluated once per parent.

        Args:
            edges: ``[B]`` long edge indices.

        Returns:
            ``(parents, inverse)``: the unique parent node indices ``[P]`` and, for each edge, the row of its parent in
            ``parents`` (``[B]``), so ``mean[inverse]`` broadcasts a per-parent mean to the edges.
        """
        parents, inverse = torch.unique(self.edge_parent[edges], return_inverse=True)
        return parents, inverse

    def validate(self) -> None:
        """Check shapes and index ranges; raises ``ValueError`` naming the offending field."""
        n, e, s = self.num_nodes, self.num_edges, self.num_samples
        problems: list[str] = []
        for name, tensor, size in (
            ("node_step", self.node_step, n),
            ("node_group", self.node_group, n),
            ("edge_child", self.edge_child, e),
            ("old_log_probs", self.old_log_probs, e),
            ("trainable", self.trainable, e),
            ("edge_kernel", self.edge_kernel, e),
            ("sample_group", self.sample_group, s),
            ("media", self.media, s),
        ):
            if int(tensor.shape[0]) != size:
                problems.append(f"{name} has {int(tensor.shape[0])} rows, expected {size}")
        for name, tensor in self.edge_extras.items():
            if not isinstance(tensor, Tensor) or tensor.ndim < 1 or int(tensor.shape[0]) != e:
                rows = int(tensor.shape[0]) if isinstance(tensor, Tensor) and tensor.ndim else "no"
                problems.append(f"edge_extras[{name!r}] has {rows} rows, expected {e}")
        if e and (
            int(self.edge_parent.max()) >= n or int(self.edge_child.max()) >= n or int(self.edge_parent.min()) < 0
        ):
            problems.append("edge_parent/edge_child index outside the node table")
        if s and (int(self.sample_node.max()) >= n or int(self.sample_node.min()) < 0):
            problems.append("sample_node index outside the node table")
        if n and int(self.node_group.max()) >= len(self.prompts):
            problems.append("node_group index outside prompts")
        if len(self.metadata) != len(self.prompts):
            problems.append("metadata and prompts differ in length")
        if self.trainable.dtype != torch.bool:
            problems.append(f"trainable must be bool, got {self.trainable.dtype}")
        if self.media.dtype != torch.uint8:
            problems.append(f"media must be uint8, got {self.media.dtype}")
        if self.media.ndim != 5 or self.media.shape[-1] != 3:
            problems.append(f"media must be [S, F, H, W, 3] (F = 1 for images), got {list(self.media.shape)}")
        if e and int(self.edge_kernel.max()) >= len(self.kernels):
            problems.append("edge_kernel index outside kernels")
        if problems:
            raise ValueError("invalid Rollout: " + "; ".join(problems))


@dataclass(frozen=True)
class RewardScores:
    """Per-source reward scores for the samples of a rollout. Never pre-summed: aggregation order matters
    (summing before normalising collapses multi-reward signal, huggingface/trl issue #4841), so mixing belongs to the
    advantage estimator.

    Attributes:
        scores: Source name -> ``[S]`` float tensor aligned with ``Rollout.media`` (one score per sample, whatever
            its frame count: :mod:`rlpost.ops.media` reduces an image reward's per-frame scores).
        weights: Source name -> weight given in the recipe (``reward_weights``), 1.0 by default.
    """

    scores: dict[str, Tensor]
    weights: dict[str, float]

    def __post_init__(self) -> None:
        if set(self.scores) != set(self.weights):
            raise ValueError(f"RewardScores: scores for {sorted(self.scores)} but weights for {sorted(self.weights)}")

    def weighted_sum(self) -> Tensor:
        """``Σ_k w_k R_k`` per sample (reward-level mixing)."""
        total: Tensor | None = None
        for name, value in self.scores.items():
            term = self.weights[name] * value.float()
            total = term if total is None else total + term
        if total is None:
            raise ValueError("RewardScores holds no reward source")
        return total
