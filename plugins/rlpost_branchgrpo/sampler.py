"""BranchGRPO's branching sampler (Li et al., arXiv 2509.06040, Sec. 3.2; ``Fredreic1849/BranchGRPO``
``fastvideo/train_branchgrpo_flux.py``@19fbb9f, ``run_tree_sample_step`` L337-532 and ``flux_step_with_split``
L229-311).

One tree per prompt group, grown over the whole schedule ``σ_0 = 1 > … > σ_T = 0``:

* one initial noise per tree (``policy.initial_noise`` with the run's rollout generator);
* every step ``t`` evaluates each frontier node **once** (one transformer row per node, batched over the frontier of
  every tree, chunked by ``chunk_size``) and takes DanceGRPO's SDE step (the ``dance-sde`` kernel, ``η``). At a split
  step (``t ∈ split_points``) each node gets ``num_splits`` children ``μ + split_noise_scale·z·s``, scored under the
  *unscaled* step Gaussian ``N(μ, s²)`` (upstream L266-285: scaled noise, log-prob with ``std_dev_t``); elsewhere one
  child ``μ + z·s`` (upstream L286-293). Every such edge is recorded with its ``log π_old``;
* the last ``final_ode_steps`` steps are Euler ODE steps (one child, NaN log-prob, never trained). With the default 1
  the step ``σ_{T-1} → 0`` lands on ``x̂0 = x - σ_{T-1}·v``, exactly the image upstream decodes (L835-840 decode the
  ``pred_original`` of the last step, never the sampled state), so the leaves hold the decoded clean latents;
* the leaves (``∏ num_splits`` per tree, 16 for splits at 0,3,6,9) are decoded and scored.

Which SDE edges are trained (upstream L1199-1470: every tree edge is a training sample, then depth and width pruning
drop some) is decided here, in the rollout's ``trainable`` mask, so :meth:`BranchSampler.counts` stays exact:

* ``depth_pruning``: edges whose child depth (= parent step + 1) is listed are not trained (L1270-1320); with
  ``depth_pruning_slide`` the listed depths move up by one every ``slide_interval`` training steps, until the
  shallowest reaches ``stop_depth`` (default: the last split step, upstream's ``auto_stop_depth``).
* ``width_pruning: best-per-branch`` (upstream ``--width_pruning_mode 1``, L1325-1420): after the last split every
  leaf's chain keeps the ``max(1, int(n·width_pruning_ratio))`` of its ``n`` remaining edges that have the largest
  advantage. Every node of such a chain leads to the same single leaf, so its fused reward is that leaf's at every
  depth and the per-depth z-scores of one chain are bit-identical; upstream's stable sort then keeps the chain's
  first edges in tree order (the lowest steps). The rule is therefore reward-independent and applied here exactly.
  Mode 2 (global best/worst) depends on rewards and is not implemented (``docs/algorithms/branchgrpo.md``).
* ``prune_until_step``: pruning applies to training steps ``1 … prune_until_step`` (1-based, upstream's
  ``current_step <= int(max_train_steps · pruning_step_ratio)``, L1259-1266); ``null`` = always.

The per-step state (the training step, for sliding and ``prune_until_step``) is set in :meth:`begin_step`;
:meth:`counts` follows it, as for MixGRPO's window.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal

import torch
from torch import Tensor

from rlpost import (
    CLEAN_SAMPLES,
    EDGE_LOG_PROBS,
    TREE,
    EdgeEval,
    LogProbReduction,
    NoiseSource,
    PerGroupNoise,
    Policy,
    PromptBatch,
    Range,
    Rollout,
    RolloutBuilder,
    Sampler,
    SharedNoise,
    StepCounts,
    StepKernel,
    branch_children,
    evaluate_edges,
    frontier_velocity,
    make_kernel,
)

__all__ = ["BranchSampler"]

WidthPruning = Literal["off", "best-per-branch"]


class BranchSampler(Sampler):
    """BranchGRPO's tree: ``num_splits`` children per node at each split step, one stochastic child elsewhere.

    Args:
        num_steps: Schedule length ``T`` (NFE per leaf path; upstream ``--sampling_steps 20``).
        split_points: Steps at which every frontier node branches (upstream ``--tree_split_points "0,3,6,9"``).
            Each must lie in ``[0, T - final_ode_steps - 1]``.
        num_splits: Children per node at a split step (upstream hard-codes 2).
        eta: ``η`` of DanceGRPO's SDE (``μ = x + dt·(v - ½η²ŝ)``, std ``η·sqrt(σ - σ')``); upstream ``--eta 0.3``.
        split_noise_scale: Split children are ``μ + split_noise_scale·z·s`` but scored under ``N(μ, s²)``
            (upstream ``--tree_split_noise_scale``: argparse 0.3, launch script 4.0). 1 makes the recorded density the
            sampling density.
        final_ode_steps: Final steps taken by the deterministic Euler step (never trained). 1 (default) is the step
            to 0, whose result is upstream's decoded ``x̂0``; 2 also keeps the step into ``σ_min`` deterministic on
            grids that end ``… → σ_min → 0`` (SD3's ``diffusers`` grid), where sampled noise would stay in the image.
        depth_pruning: Child depths whose edges are not trained (upstream ``--depth_pruning``); ``null``: none.
        depth_pruning_slide: Slide the pruned depths up by one every ``slide_interval`` training steps.
        slide_interval: Training steps per slide (upstream ``--depth_pruning_slide_interval``, default 1).
        stop_depth: Lowest depth the slide may reach (``null``: the last split step, upstream's default).
        width_pruning: ``"off"`` or ``"best-per-branch"`` (upstream mode 1; see the module docstring).
        width_pruning_ratio: Fraction of each chain's post-split edges kept by width pruning (upstream 0.5).
        prune_until_step: Last training step (1-based) that prunes; ``null``: every step (upstream ratio 1.0).
        logprob_reduction: ``"mean"`` (per-element mean, upstream) or ``"sum"`` over latent elements.
        chunk_size: Maximum rows per transformer forward and per VAE decode (memory budget only).
    """

    name: ClassVar[str] = "branch"
    provides: ClassVar[frozenset[str]] = frozenset({TREE, CLEAN_SAMPLES, EDGE_LOG_PROBS})

    def __init__(
        self,
        num_steps: Annotated[int, Range(ge=2)] = 20,
        split_points: list[int] | None = None,
        num_splits: Annotated[int, Range(ge=2)] = 2,
        eta: Annotated[float, Range(gt=0)] = 0.3,
        split_noise_scale: Annotated[float, Range(gt=0)] = 1.0,
        final_ode_steps: Annotated[int, Range(ge=1)] = 1,
        depth_pruning: list[int] | None = None,
        depth_pruning_slide: bool = False,
        slide_interval: Annotated[int, Range(ge=1)] = 1,
        stop_depth: Annotated[int, Range(ge=0)] | None = None,
        width_pruning: WidthPruning = "off",
        width_pruning_ratio: Annotated[float, Range(gt=0, le=1)] = 0.5,
        prune_until_step: Annotated[int, Range(ge=0)] | None = None,
        logprob_reduction: LogProbReduction = "mean",
        chunk_size: Annotated[int, Range(ge=1)] = 16,
    ) -> None:
        self.num_steps = int(num_steps)
        self.split_points = [0, 3, 6, 9] if split_points is None else [int(p) for p in split_points]
        self.num_splits = int(num_splits)
        self.eta = float(eta)
        self.split_noise_scale = float(split_noise_scale)
        self.final_ode_steps = int(final_ode_steps)
        self.depth_pruning = sorted(int(d) for d in depth_pruning or [])
        self.depth_pruning_slide = bool(depth_pruning_slide)
        self.slide_interval = int(slide_interval)
        self.stop_depth = stop_depth
        self.width_pruning: WidthPruning = width_pruning
        self.width_pruning_ratio = float(width_pruning_ratio)
        self.prune_until_step = prune_until_step
        self.logprob_reduction: LogProbReduction = logprob_reduction
        self.chunk_size = int(chunk_size)
        self.kernel_names = ["dance-sde", "ode"]
        self.kernels: list[StepKernel | None] = [make_kernel("dance-sde", eta=self.eta), make_kernel("ode")]
        self.step = 0  # the training step begin_step set (0-based)

    # ------------------------------------------------------------------------------------------ configuration

    @property
    def sde_steps(self) -> int:
        """Steps taken by the SDE (``T - final_ode_steps``); splits and training happen among them."""
        return self.num_steps - self.final_ode_steps

    def frontier_sizes(self) -> list[int]:
        """``[T + 1]`` nodes per tree at each depth: ``n_0 = 1``, ``n_{t+1} = n_t · (num_splits if t splits)``."""
        sizes = [1]
        for t in range(self.num_steps):
            sizes.append(sizes[-1] * (self.num_splits if t in self.split_points else 1))
        return sizes

    def pruned_depths(self, step: int) -> list[int]:
        """Child depths not trained at training step ``step`` (0-based), sliding applied (upstream L1270-1300)."""
        if not self.depth_pruning or not self._prunes(step):
            return []
        base = self.depth_pruning
        if not self.depth_pruning_slide:
            return list(base)
        stop = self.stop_depth
        if stop is None:
            stop = max(self.split_points) if self.split_points else 0
        # Upstream counts training steps from 1 and shifts by current_step // interval, at most base[0] - stop.
        shift = min((step + 1) // self.slide_interval, max(0, base[0] - stop))
        return [d - shift for d in base]

    def trained_steps(self, step: int) -> list[int]:
        """Schedule steps whose edges are trained at training step ``step`` (every edge of a step shares its flag)."""
        pruned = set(self.pruned_depths(step))
        steps = [t for t in range(self.sde_steps) if t + 1 not in pruned]
        if self.width_pruning == "best-per-branch" and self._prunes(step) and self.split_points:
            last = max(self.split_points)
            tail = [t for t in steps if t > last]
            if tail:
                keep = max(1, int(len(tail) * self.width_pruning_ratio))
                steps = [t for t in steps if t <= last] + tail[:keep]
        return steps

    def _prunes(self, step: int) -> bool:
        return self.prune_until_step is None or step + 1 <= self.prune_until_step

    def validate(self, recipe: Any) -> list[str]:
        """Check the split points, the pruning settings and the model's grid (every problem names its field)."""
        p = "sampler.init_args"
        problems: list[str] = []
        if self.final_ode_steps >= self.num_steps:
            problems.append(
                f"{p}.final_ode_steps: must be below num_steps ({self.num_steps}), got {self.final_ode_steps}"
            )
        bad = [s for s in self.split_points if not 0 <= s < self.sde_steps]
        if bad or len(set(self.split_points)) != len(self.split_points):
            problems.append(
                f"{p}.split_points: need distinct SDE steps in [0, {self.sde_steps - 1}] (num_steps - final_ode_steps "
                f"- 1), got {self.split_points}"
            )
        if not self.split_points:
            problems.append(f"{p}.split_points: at least one split is needed (one leaf per tree gives no comparison)")
        if any(d < 1 or d > self.num_steps for d in self.depth_pruning):
            problems.append(f"{p}.depth_pruning: depths must be in [1, {self.num_steps}], got {self.depth_pruning}")
        if self.width_pruning not in ("off", "best-per-branch"):
            problems.append(f"{p}.width_pruning: must be 'off' or 'best-per-branch', got {self.width_pruning!r}")
        elif not problems and not self.trained_steps(self.step):
            problems.append(f"{p}.depth_pruning: every SDE step is pruned; nothing would be trained")
        model = getattr(recipe, "model", None)
        tail = model.clean_tail_steps() if isinstance(model, Policy) else None
        if tail is not None and tail > self.final_ode_steps:
            problems.append(
                f"{p}.final_ode_steps: the model's grid ends in {tail} (near-)clean steps (model.init_args.time_grid "
                f"{getattr(model, 'time_grid', None)!r}); sampled noise in them would stay in the decoded image. Set "
                f"final_ode_steps: {tail}, or time_grid 'shifted-linspace' (upstream's grid)"
            )
        return problems

    # ------------------------------------------------------------------------------------------------ counts

    def counts(self, num_groups: int, samples_per_group: int) -> StepCounts:
        """Closed-form counts at the step :meth:`begin_step` set; ``samples_per_group`` is ignored (leaves per prompt
        = ``∏ num_splits``). With ``n_t`` nodes per tree at depth ``t`` (:meth:`frontier_sizes`) and the trained
        steps ``𝒯`` (:meth:`trained_steps`): images ``G·n_T``, rollout rows ``G·Σ_{t<T} n_t``, trained edges
        ``G·Σ_{t∈𝒯} n_{t+1}`` from ``G·Σ_{t∈𝒯} n_t`` parent forwards."""
        n = self.frontier_sizes()
        trained = self.trained_steps(self.step)
        return StepCounts(
            images=num_groups * n[-1],
            trainable_edges=num_groups * sum(n[t + 1] for t in trained),
            rollout_forwards=num_groups * sum(n[:-1]),
            train_forwards=num_groups * sum(n[t] for t in trained),
        )

    # ----------------------------------------------------------------------------------------------- rollout

    def begin_step(self, step: int, generator: torch.Generator) -> None:
        """Remember the training step (sliding depth pruning and ``prune_until_step`` depend on it; no draw)."""
        self.step = int(step)

    def rollout(self, policy: Policy, batch: PromptBatch, generator: torch.Generator) -> Rollout:
        """Grow one tree per prompt group, decode and score its leaves, record every step as an edge.

        RNG order on ``generator``: the initial noises ``[G, ...]``, then for each SDE step one ``[F·c, ...]`` block
        of standard normals (``F`` = frontier size, ``c`` = children per node at that step, children adjacent)."""
        return self._grow(policy, batch, SharedNoise(generator, batch.num_groups))

    def rollout_groups(self, policy: Policy, batch: PromptBatch, generators: Sequence[torch.Generator]) -> Rollout:
        """All groups in one forward per step, group ``j`` drawing from ``generators[j]`` what :meth:`rollout` of it
        alone draws (group ``j``'s rows are a contiguous block of every frontier).

        Raises:
            ValueError: When the number of generators differs from the number of groups.
        """
        if len(generators) != batch.num_groups:
            raise ValueError(f"rollout_groups: {batch.num_groups} groups but {len(generators)} generators")
        return self._grow(policy, batch, PerGroupNoise(list(generators)))

    def _grow(self, policy: Policy, batch: PromptBatch, noise: NoiseSource) -> Rollout:
        sde, ode = self.kernels[0], self.kernels[1]
        assert sde is not None and ode is not None
        sigmas = policy.sigmas(self.num_steps).detach().float().cpu()
        device = policy.device
        builder = RolloutBuilder(batch, sigmas, self.kernel_names)
        cond = policy.encode(batch.prompts)
        groups = torch.arange(batch.num_groups)
        x = noise.initial(policy, 1).to(device, torch.float32)
        ids = builder.add_nodes(x, 0, groups)
        trained = set(self.trained_steps(self.step))
        forwards = calls = 0
        for t in range(self.num_steps):
            f = x.shape[0]
            sigma = sigmas[t].to(device).expand(f)
            sigma_next = sigmas[t + 1].to(device).expand(f)
            v = frontier_velocity(policy, x, sigma, cond, groups, self.chunk_size)
            forwards += f
            calls += -(-f // self.chunk_size)
            if t < self.sde_steps:
                c = self.num_splits if t in self.split_points else 1
                z = noise.normal(f * c // batch.num_groups, x.shape[1:]).to(device)
                if c > 1:
                    # Wider children, scored under the unscaled step Gaussian (upstream L266-280).
                    z = z * self.split_noise_scale
                out = branch_children(sde, x, v, sigma, sigma_next, c, z, self.logprob_reduction)
                parents, groups = ids.repeat_interleave(c), groups.repeat_interleave(c)
                trainable, kernel_index = t in trained, 0
            else:
                out = ode.step(x, v, sigma, sigma_next, None, self.logprob_reduction)
                parents, trainable, kernel_index = ids, False, 1
            x = out.next_latents
            ids = builder.add_nodes(x, t + 1, groups)
            builder.add_edges(parents, ids, out.log_prob, trainable, kernel_index)
        media = torch.cat([policy.decode(x[c : c + self.chunk_size]) for c in range(0, x.shape[0], self.chunk_size)])
        counts = self.counts(batch.num_groups, 1)
        stats = {
            "branch/leaves": float(x.shape[0]),
            "branch/trained_edges": float(counts.trainable_edges),
            "branch/pruned_depths": float(len(self.pruned_depths(self.step))),
            "perf/rollout_forwards": float(forwards),
            "perf/rollout_calls": float(calls),
        }
        return builder.build(ids, media, stats)

    def evaluate(self, policy: Policy, rollout: Rollout, edges: Tensor) -> EdgeEval:
        """Recompute the edges' log-probs under the unscaled step Gaussian, one forward per parent (upstream
        ``grpo_one_step`` L715-757 evaluates ``flux_step_with_split`` with the stored next state)."""
        if rollout.kernels != self.kernel_names:
            raise ValueError(f"rollout kernels {rollout.kernels} do not match this sampler's {self.kernel_names}")
        return evaluate_edges(policy, rollout, edges, self.kernels, self.logprob_reduction)

    def __repr__(self) -> str:
        return (
            f"BranchSampler(T={self.num_steps}, splits={self.split_points}x{self.num_splits}, eta={self.eta}, "
            f"split_noise_scale={self.split_noise_scale}, final_ode_steps={self.final_ode_steps}, "
            f"depth_pruning={self.depth_pruning or None}, width_pruning={self.width_pruning!r})"
        )
