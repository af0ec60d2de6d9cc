"""TreeNFT's update rule: DiffusionNFT's likelihood-free loss (Zheng et al., arXiv 2509.16117, Sec. 3) trained at the
nodes of TreeGRPO's search tree (Ding & Ye, arXiv 2512.08153, Sec. "Method") instead of at freshly re-noised samples.

Per training step, on this rank's trees:

1. every decoded leaf ``ℓ`` gets its optimality ``r_ℓ = clip(clip(A_ℓ, -M, M)/M/2 + 1/2, 0, 1)`` from its advantage
   ``A_ℓ = Advantages.samples`` (the per-prompt leaf z-score of ``tree-backup`` / ``leaf-zscore``);
2. the trained nodes ``u`` are the window's parent nodes (parents of trainable edges), with ``nodes: window+trunk``
   also the trunk nodes above the window; each has its state ``x_u`` at ``σ_u = Rollout.sigmas[node_step]``;
3. one live forward ``v_θ(x_u, σ_u)`` (with gradient) and one forward of the ``old`` copy (no gradient; of the frozen
   reference too when ``kl_beta > 0``) per trained node, at guidance ``train_guidance``;
4. for every pair (``u``, leaf ``ℓ`` below ``u``) with the leaf's clean latent ``x0_ℓ`` (the state its sample node
   holds before decoding), DiffusionNFT's per-row loss :func:`rlpost.nft_loss` with ``x_t = x_u``, ``t = σ_u``,
   ``x0 = x0_ℓ``: the flow-matching target is ``v* = (x_u - x0_ℓ)/σ_u`` (from ``x_σ = (1-σ)·x0 + σ·ε``,
   ``ε - x0 = (x_σ - x0)/σ``), ``x̂0± = x_u - σ_u·v±`` with the implicit policies ``v± `` of ``v_θ`` and ``v_old``;
5. a node's loss is the mean over its leaves of ``M·(r·L⁺ + (1-r)·L⁻)/β + β_KL·mean (v_θ - v_ref)²``; with
   ``fresh_rows: n`` every leaf also trains NFT's plain rows (re-noised at ``n`` grid levels drawn without
   replacement, fresh keyed noise), each a row of its own; the step's loss is the mean over all rows (trained nodes
   plus fresh rows) of this rank, accumulated over minibatches of ``minibatch_rows`` rows, then one optimizer step.

The ``old`` copy is the recipe's ``copies.old`` (``rlpost/engine/weight_copies.py``), soft-updated by the runner after
every step; the rollout runs under it unless ``rollout_policy: live``. ``docs/algorithms/treenft.md`` explains it.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar, Literal

import torch
from torch import Tensor

from rlpost import (
    CLEAN_SAMPLES,
    REFERENCE,
    TREE,
    CleanBatch,
    Conditioning,
    Policy,
    PolicyOptimizer,
    Range,
    Rollout,
    StepCounts,
    TrainCounts,
    UpdateContext,
    UpdateResult,
    clean_batch,
    grid_permutations,
    leaves_below,
    nft_loss,
    noise_for,
    optimality_weight,
    renoise,
)

__all__ = ["OLD", "TERMS", "TreeNFTUpdate", "trained_nodes"]

OLD = "old"
"""The weight copy TreeNFT contrasts the live policy against (recipe section ``copies``), as DiffusionNFT's."""

TERMS = ("total", "policy", "positive", "negative", "kl")
"""The per-row loss terms of :class:`rlpost.NFTTerms` that are logged as ``loss/<term>``."""

NodeSet = Literal["window", "window+trunk"]


def trained_nodes(rollout: Rollout, nodes: NodeSet) -> Tensor:
    """``[U]`` sorted node indices trained: parents of trainable edges, and with ``window+trunk`` every parent node
    at a schedule index before the earliest of them (TreeGRPO's trunk: one node per tree per step before the window).
    """
    window: Tensor = torch.unique(rollout.edge_parent[rollout.trainable])
    if nodes == "window" or window.numel() == 0:
        return window
    first = int(rollout.node_step[window].min())
    parents: Tensor = torch.unique(rollout.edge_parent)
    both: Tensor = torch.unique(torch.cat([window, parents[rollout.node_step[parents] < first]]))
    return both


class TreeNFTUpdate(PolicyOptimizer):
    """TreeNFT: DiffusionNFT's implicit positive/negative loss at a search tree's nodes, towards the leaves below.

    Args:
        beta: NFT's guidance strength β of the implicit policies ``v±``; the policy term is divided by it
            (DiffusionNFT's ``config.beta``, 1.0 in its GenEval/PickScore/HPSv2 presets).
        kl_beta: Weight of the KL term ``mean (v_θ - v_ref)²`` to the frozen reference (DiffusionNFT's
            ``config.train.beta``, 1e-4); 0 drops the term and the reference forwards.
        adv_clip_max: ``M``: leaf advantages are clipped to ±M before ``r = A/(2M) + 1/2``, and the policy term is
            multiplied by it (5, as DiffusionNFT).
        nodes: Which tree nodes are trained: ``"window"`` (the parents of the trainable edges, ``Σ_{j<d} k^j`` per
            tree) or ``"window+trunk"`` (also the ``i`` trunk nodes above a window starting at step ``i``).
        rollout_policy: ``"old"``: the tree is grown under the ``old`` copy (DiffusionNFT's off-policy sampling);
            ``"live"``: under the live weights (TreeGRPO's on-policy rollout).
        fresh_rows: NFT's plain rows added to the same loss: each leaf re-noised at this many grid levels (drawn
            without replacement, keyed like ``nft``'s) with fresh noise; 0 trains the tree's nodes only.
        minibatch_rows: Trained rows (nodes or fresh rows) per forward/backward pass (memory only; a node's pass also
            holds one loss row per leaf below it).
        train_guidance: Guidance of the training velocities (``Policy.velocity(..., guidance=...)``): 1.0 is the
            conditional branch alone (DiffusionNFT's CFG-free training); ``null`` the model's configured guidance.
    """

    name: ClassVar[str] = "tree-nft"
    requires: ClassVar[frozenset[str]] = frozenset({TREE, CLEAN_SAMPLES})

    def __init__(
        self,
        beta: Annotated[float, Range(gt=0)] = 1.0,
        kl_beta: Annotated[float, Range(ge=0)] = 1e-4,
        adv_clip_max: Annotated[float, Range(gt=0)] = 5.0,
        nodes: NodeSet = "window",
        rollout_policy: Literal["old", "live"] = "old",
        fresh_rows: Annotated[int, Range(ge=0)] = 0,
        minibatch_rows: Annotated[int, Range(ge=1)] = 16,
        train_guidance: Annotated[float, Range(ge=1)] | None = 1.0,
    ) -> None:
        self.beta = beta
        self.kl_beta = kl_beta
        self.adv_clip_max = adv_clip_max
        self.nodes: NodeSet = nodes
        self.rollout_policy: Literal["old", "live"] = rollout_policy
        self.fresh_rows = fresh_rows
        self.minibatch_rows = minibatch_rows
        self.train_guidance = train_guidance
        self._tree: Any = None  # the tree sampler, for the trunk's length (bound by validate or bind_sampler)

    # ------------------------------------------------------------------------------------------------ contract

    def required_copies(self) -> frozenset[str]:
        """The ``old`` copy (recipe section ``copies``): every loss contrasts the live policy with it."""
        return frozenset({OLD})

    def rollout_copy(self, step: int) -> str | None:
        """``old`` (default, as DiffusionNFT) or the live weights (``rollout_policy: live``)."""
        return OLD if self.rollout_policy == "old" else None

    def bind_sampler(self, sampler: Any) -> None:
        """Remember the tree sampler, whose window start sets the trunk's length (``nodes: window+trunk`` only);
        :meth:`validate` does it for a recipe."""
        self._tree = sampler

    def trunk_rows(self, counts: StepCounts) -> int:
        """Trunk nodes of the step (``nodes: window+trunk``): ``trees · i`` for the window start ``i`` whose rollout
        rows (``rollout_forwards_at``) the counts report, the latest such start when several match.

        Raises:
            ValueError: No tree sampler was bound, or none of its starts gives these rollout rows.
        """
        tree = self._tree
        if tree is None or not hasattr(tree, "rollout_forwards_at"):
            raise ValueError("tree-nft nodes 'window+trunk': bind_sampler(tree sampler) first (validate does)")
        per_group = int(tree.trees_per_prompt) * int(tree.k) ** int(tree.depth)
        groups = counts.images // per_group
        starts = [
            s
            for s in range(tree.num_steps - tree.depth)
            if tree.rollout_forwards_at(s, groups) == counts.rollout_forwards
        ]
        if not starts:
            raise ValueError(f"tree-nft: no window start of {tree!r} rolls out {counts.rollout_forwards} rows")
        return int(groups * int(tree.trees_per_prompt) * max(starts))

    def train_counts(self, counts: StepCounts) -> TrainCounts:
        """Per step: one live row with gradients per trained node plus ``images · fresh_rows`` fresh rows, as many
        no-grad rows of ``old`` (and of ``reference`` when ``kl_beta > 0``), ``minibatch_rows`` rows per call.

        The window's parent nodes are the tree sampler's ``train_forwards`` (one per parent of a trainable edge,
        ``trees · Σ_{j<d} k^j``); the trunk adds :meth:`trunk_rows`."""
        nodes = counts.train_forwards + (self.trunk_rows(counts) if self.nodes == "window+trunk" else 0)
        rows = nodes + counts.images * self.fresh_rows
        nograd = {OLD: rows, REFERENCE: rows if self.kl_beta > 0 else 0}
        return TrainCounts(
            grad_rows=rows,
            nograd_rows={k: v for k, v in nograd.items() if v},
            rows_per_call=min(self.minibatch_rows, max(rows, 1)),
        )

    def validate(self, recipe: Any) -> list[str]:
        """Check that fresh rows fit the rollout's grid, that a KL term has a reference, and bind the sampler for
        the trunk's count."""
        field = "optimizer.init_args."
        problems = []
        sampler = recipe.sampler
        self.bind_sampler(sampler)
        steps, depth = getattr(sampler, "num_steps", None), getattr(sampler, "depth", None)
        if self.fresh_rows and isinstance(steps, int) and isinstance(depth, int):
            # A shortened tail leaves at least depth + 1 levels in the rollout's grid (window, one tail step).
            grid = steps if getattr(sampler, "tail", "full") == "full" else depth + 1
            if self.fresh_rows > grid:
                problems.append(
                    f"{field}fresh_rows: {self.fresh_rows} levels per leaf, but the rollout's grid may have only "
                    f"{grid}; lower it"
                )
        if self.nodes == "window+trunk" and not hasattr(sampler, "rollout_forwards_at"):
            problems.append(f"{field}nodes: 'window+trunk' needs the 'tree' sampler (its window start is the trunk)")
        model = recipe.model
        if self.kl_beta > 0 and getattr(model, "full_finetune", False) and not getattr(model, "use_reference", True):
            problems.append(
                f"{field}kl_beta: {self.kl_beta} needs a frozen reference, but the model is fully fine-tuned without "
                "one; set model.init_args.reference: true, or kl_beta: 0"
            )
        return problems

    # -------------------------------------------------------------------------------------------------- update

    def update(self, ctx: UpdateContext) -> UpdateResult:
        """One step of TreeNFT on this rank's trees, one optimizer step (the module docstring)."""
        rollout, policy = ctx.rollout, ctx.policy
        batch = clean_batch(ctx)
        nodes = trained_nodes(rollout, self.nodes)
        pair_node, pair_sample = leaves_below(rollout, nodes)
        row_of = torch.full((rollout.num_nodes,), -1, dtype=torch.long)
        row_of[nodes] = torch.arange(nodes.numel())
        pair_row = row_of[pair_node]
        grid = int(rollout.sigmas.numel()) - 1
        fresh = min(self.fresh_rows, grid)
        rows = nodes.numel() + batch.size * fresh
        if rows == 0:
            return UpdateResult(trained_edges=0, train_forwards=0, reference_forwards=0, nonfinite_losses=0)
        r = optimality_weight(batch.advantages, self.adv_clip_max)
        sigmas = rollout.sigmas.detach().to(torch.float32).cpu()
        cond = policy.encode(rollout.prompts)
        stats: dict[str, float] = {}
        nonfinite = 0
        policy.train(True)
        try:
            for chunk in torch.split(torch.arange(nodes.numel()), self.minibatch_rows):
                u = nodes[chunk]
                x = rollout.states[u].detach().to(policy.device, torch.float32)
                t = sigmas[rollout.node_step[u]].to(policy.device)
                in_chunk = (pair_row >= int(chunk[0])) & (pair_row <= int(chunk[-1]))
                local = (pair_row[in_chunk] - int(chunk[0])).to(policy.device)
                leaves = pair_sample[in_chunk].to(policy.device)
                row_cond = cond.select(rollout.node_group[u])
                nonfinite += self._rows(ctx, x, t, row_cond, local, batch.x0[leaves], r[leaves], rows, stats)
            if fresh:
                slots = grid_permutations(ctx.seed, ctx.step, batch.keys, grid, fresh)  # [S, fresh] grid indices
                pairs = [(s, int(slots[s, j])) for s in range(batch.size) for j in range(fresh)]
                for start in range(0, len(pairs), self.minibatch_rows):
                    nonfinite += self._fresh(
                        ctx, batch, pairs[start : start + self.minibatch_rows], sigmas, r, rows, stats
                    )
            step_metrics = ctx.backend.step()
        finally:
            policy.train(False)
        return self._result(batch, r, nodes.numel(), pair_row, fresh, rows, nonfinite, stats, step_metrics)

    def _velocity(self, policy: Policy, x: Tensor, t: Tensor, cond: Conditioning) -> Tensor:
        return policy.velocity(x, t, cond, guidance=self.train_guidance)

    def _rows(
        self,
        ctx: UpdateContext,
        x: Tensor,
        t: Tensor,
        cond: Conditioning,
        local: Tensor,
        x0: Tensor,
        r: Tensor,
        rows: int,
        stats: dict[str, float],
    ) -> int:
        """Forward/backward of one minibatch of ``B`` rows (states ``x`` at levels ``t``), each paired with the
        clean latents ``x0[p]`` of its leaves (``local[p]`` = the row of pair ``p``): the rows' losses are the means
        over their pairs. Adds the summed metrics to ``stats``; returns the non-finite losses kept from ``backward``.
        """
        policy = ctx.policy
        with torch.no_grad():
            with ctx.weight_copies.use(OLD):
                v_old = self._velocity(policy, x, t, cond)
            v_ref = None
            if self.kl_beta > 0:
                with ctx.weight_copies.use(REFERENCE):
                    v_ref = self._velocity(policy, x, t, cond)
        v = self._velocity(policy, x, t, cond)
        terms = nft_loss(
            v[local],
            v_old[local],
            x0,
            x[local],
            t[local],
            r,
            beta=self.beta,
            adv_clip_max=self.adv_clip_max,
            v_ref=None if v_ref is None else v_ref[local],
            kl_beta=self.kl_beta,
        )
        zeros = torch.zeros(x.shape[0], dtype=terms.total.dtype, device=x.device)
        count = zeros.index_add(0, local, torch.ones_like(terms.total)).clamp_min(1.0)
        per_row = {k: zeros.index_add(0, local, getattr(terms, k)) / count for k in TERMS}
        loss = per_row["total"].sum() / rows
        if not torch.isfinite(loss):
            return 1  # never reaches backward; the runner's loss guard counts it
        ctx.backend.backward(loss)
        with torch.no_grad():
            stats["rows"] = stats.get("rows", 0.0) + float(x.shape[0])
            for k in TERMS:
                stats[f"loss/{k}"] = stats.get(f"loss/{k}", 0.0) + float(per_row[k].sum())
            deviate = (v.detach() - v_old).pow(2).flatten(1).mean(1)
            stats["train/old_deviate"] = stats.get("train/old_deviate", 0.0) + float(deviate.double().sum())
            stats["train/sigma"] = stats.get("train/sigma", 0.0) + float(t.double().sum())
        return 0

    def _fresh(
        self,
        ctx: UpdateContext,
        batch: CleanBatch,
        pairs: list[tuple[int, int]],
        sigmas: Tensor,
        r: Tensor,
        rows: int,
        stats: dict[str, float],
    ) -> int:
        """NFT's plain rows for ``pairs`` of (sample, grid index): the sample re-noised at that level with the keyed
        fresh noise :func:`rlpost.noise_for` (one leaf per row)."""
        device = ctx.policy.device
        index = torch.tensor([s for s, _ in pairs])
        x0 = batch.x0[index]
        noise = torch.stack([noise_for(ctx.seed, ctx.step, batch.keys[s], x0.shape[1:], i) for s, i in pairs])
        t = sigmas[torch.tensor([i for _, i in pairs])].to(device)
        x_t = renoise(x0, t, noise.to(device))
        local = torch.arange(len(pairs), device=device)
        return self._rows(ctx, x_t, t, batch.cond.select(index), local, x0, r[index.to(r.device)], rows, stats)

    def _result(
        self,
        batch: CleanBatch,
        r: Tensor,
        num_nodes: int,
        pair_row: Tensor,
        fresh: int,
        rows: int,
        nonfinite: int,
        stats: dict[str, float],
        step_metrics: dict[str, float],
    ) -> UpdateResult:
        done = stats.pop("rows", 0.0)
        # Means over the rows (trained nodes and fresh rows) whose loss was finite; NaN when none was.
        metrics = {k: stats.get(k, 0.0) / done if done else math.nan for k in [f"loss/{t}" for t in TERMS]}
        metrics["train/old_deviate"] = stats.get("train/old_deviate", 0.0) / done if done else math.nan
        metrics["train/sigma_mean"] = stats.get("train/sigma", 0.0) / done if done else math.nan
        adv = batch.advantages
        leaves = torch.bincount(pair_row, minlength=num_nodes).double() if num_nodes else torch.zeros(1)
        metrics.update(
            {
                "train/optimality_r_mean": float(r.mean()) if r.numel() else math.nan,
                "train/optimality_r_min": float(r.min()) if r.numel() else math.nan,
                "train/optimality_r_max": float(r.max()) if r.numel() else math.nan,
                "train/adv_clipped_frac": float((adv.abs() > self.adv_clip_max).float().mean()) if adv.numel() else 0.0,
                "train/nodes": float(num_nodes),
                "train/pairs": float(pair_row.numel()),
                "train/leaves_per_node": float(leaves.mean()),
                "train/fresh_rows": float(batch.size * fresh),
                "train/optimizer_steps": 1.0,
                "train/grad_norm": float(step_metrics.get("train/grad_norm", math.nan)),
                "train/lr": float(step_metrics.get("train/lr", math.nan)),
            }
        )
        copies = {OLD: rows, REFERENCE: rows if self.kl_beta > 0 else 0}
        return UpdateResult(
            trained_edges=0,  # likelihood-free: no edge log-probability is trained
            train_forwards=rows,
            reference_forwards=sum(copies.values()),
            nonfinite_losses=nonfinite,
            metrics=metrics,
            copy_forwards={k: v for k, v in copies.items() if v},
        )
