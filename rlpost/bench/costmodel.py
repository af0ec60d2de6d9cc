"""The time cost model: per-row transformer costs calibrated on this machine, the closed-form counts of an iteration
(:meth:`rlpost.core.api.Sampler.step_counts`), and the seconds per iteration they predict.

Everything here reads the components through their declared interfaces (:class:`rlpost.core.api.Sampler`'s counts and
``chunk_size``, :class:`rlpost.core.api.PolicyOptimizer`'s ``inner_epochs`` and ``minibatch_edges``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlpost.core.api import StepCounts
from rlpost.engine.phases import PhaseTimer
from rlpost.engine.recipe import Recipe
from rlpost.ops.media import score_media

__all__ = ["Calibration", "calibrate", "nominal_batches", "predict_seconds", "predicted_counts"]


@dataclass
class Calibration:
    """Per-row seconds of a no-grad forward and of a forward+backward at several batch sizes, and decode+reward
    seconds per image, measured on this machine with the bench's own policy."""

    batch_sizes: list[int]
    forward_s_per_row: list[float]
    fwd_bwd_s_per_row: list[float]
    decode_reward_s_per_image: float

    def per_row(self, kind: str, batch: float) -> float:
        """Per-row cost at ``batch`` rows per call, interpolated linearly in log(batch) between measured sizes."""
        ys = self.forward_s_per_row if kind == "forward" else self.fwd_bwd_s_per_row
        xs = [math.log(b) for b in self.batch_sizes]
        x = math.log(max(1.0, batch))
        if x <= xs[0]:
            return ys[0]
        if x >= xs[-1]:
            return ys[-1]
        for i in range(len(xs) - 1):
            if xs[i] <= x <= xs[i + 1]:
                w = (x - xs[i]) / (xs[i + 1] - xs[i])
                return ys[i] * (1 - w) + ys[i + 1] * w
        return ys[-1]


def calibrate(recipe: Recipe, batch_sizes: Sequence[int], repeats: int) -> Calibration:
    """Micro-benchmark the set-up policy's transformer (forward; forward+backward through the trainable weights) at
    each batch size, and decode + every training reward per image. Gradients are cleared afterwards, so the run's
    optimizer state is untouched; the policy's ``forward_count`` grows, which only shifts the baseline the bench
    takes differences from."""
    policy = recipe.model
    gen = torch.Generator().manual_seed(12345)
    pairs = recipe.prompts.load()
    prompts, meta_all = [p for p, _ in pairs], [m for _, m in pairs]
    timer = PhaseTimer(sync_cuda=policy.device.type == "cuda")
    fwd: list[float] = []
    fb: list[float] = []
    for b in batch_sizes:
        # Prompts of their own: the policy caches embeddings per prompt string, and an embedding computed inside a
        # calibration batch could differ in the last bit (bf16) from the one training and evaluation would compute.
        cond = policy.encode([f"calibration prompt {i}" for i in range(b)])
        x = policy.initial_noise(b, gen)
        sigma = torch.full((b,), 0.5)
        samples_f: list[float] = []
        samples_fb: list[float] = []
        for r in range(repeats + 1):  # the first call of each size warms up allocator and kernels
            timer.start_step()
            with timer.timed("forward"), torch.no_grad():
                policy.velocity(x, sigma, cond)
            policy.train(True)  # as the update rule does (gradient checkpointing, if enabled, is active then)
            with timer.timed("fwd_bwd"):
                loss = policy.velocity(x, sigma, cond).square().mean()
                loss.backward()  # type: ignore[no-untyped-call]
            policy.train(False)
            if r:
                samples_f.append(timer.current["forward"] / b)
                samples_fb.append(timer.current["fwd_bwd"] / b)
        fwd.append(statistics.median(samples_f))
        fb.append(statistics.median(samples_fb))
    for p in policy.trainable_parameters():
        p.grad = None
    # Decode + reward on a batch the size of a typical rollout decode.
    n = max(batch_sizes)
    rows = [prompts[i % len(prompts)] for i in range(n)]
    meta = [dict(meta_all[i % len(meta_all)]) for i in range(n)]
    latents = policy.initial_noise(n, gen).clamp(-1, 1)
    per_image: list[float] = []
    for r in range(repeats + 1):
        timer.start_step()
        with timer.timed("decode_reward"):
            media = policy.decode(latents)
            for reward in recipe.rewards:  # as the runner scores them (frame by frame for image rewards)
                score_media(reward, media, rows, meta, recipe.reward_frames.reduction)
        if r:
            per_image.append(timer.current["decode_reward"] / n)
    return Calibration(list(batch_sizes), fwd, fb, statistics.median(per_image))


def step_counts(recipe: Recipe) -> StepCounts:
    """The counts of the step the sampler last began (:meth:`rlpost.core.api.Sampler.step_counts`)."""
    return recipe.sampler.step_counts(recipe.run.groups_per_step, recipe.run.samples_per_group)


def nominal_batches(recipe: Recipe, counts: StepCounts) -> tuple[float, float]:
    """Rows per transformer call in the rollout and in the update, from the recipe alone.

    Rollout: tails/chains run the full frontier (``images``) at once, capped by the sampler's ``chunk_size``.
    Update: the rule's ``TrainCounts.rows_per_call`` when it sets one, else parents per minibatch =
    ``minibatch_edges`` / (edges per parent), capped by the step's parents.
    """
    chunk = float(recipe.sampler.chunk_size or counts.images)
    rollout_b = min(chunk, float(counts.images))
    rule = recipe.optimizer.train_counts(counts)
    if rule.rows_per_call > 0:  # a rule that batches its own rows (a likelihood-free rule's samples x timesteps)
        return rollout_b, float(min(rule.rows_per_call, max(1, rule.grad_rows)))
    edges_per_parent = counts.trainable_edges / max(1, counts.train_forwards)
    mb_edges = float(recipe.optimizer.minibatch_edges or counts.trainable_edges)
    train_b = min(float(counts.train_forwards), max(1.0, mb_edges / edges_per_parent))
    return rollout_b, train_b


def predicted_counts(recipe: Recipe) -> dict[str, float]:
    """Closed-form counts of the iteration the sampler last began (call it after the step: TreeGRPO's window start
    and MixGRPO's window are set by ``begin_step``).

    ``rollout_forwards_expected`` is the mean over the sampler's per-step draws (equal to ``rollout_forwards`` for
    chains).
    """
    run = recipe.run
    c = step_counts(recipe)
    expected = recipe.sampler.expected_rollout_forwards(run.groups_per_step, run.samples_per_group)
    rule = recipe.optimizer.train_counts(c)  # the update rule owns its cost (PolicyOptimizer.train_counts)
    return {
        "images": float(c.images),
        "trainable_edges": float(c.trainable_edges),
        "rollout_forwards": float(c.rollout_forwards),
        "rollout_forwards_expected": float(expected),
        "train_forwards": float(rule.grad_rows),
        "reference_forwards": float(rule.nograd_total),
    }


def predict_seconds(recipe: Recipe, calib: Calibration) -> dict[str, float]:
    """Seconds per iteration from the closed-form counts and the calibration (no overhead term)."""
    pred = predicted_counts(recipe)
    rollout_b, train_b = nominal_batches(recipe, step_counts(recipe))
    rollout = pred["rollout_forwards_expected"] * calib.per_row("forward", rollout_b)
    train = pred["train_forwards"] * calib.per_row("fwd_bwd", train_b)
    reference = pred["reference_forwards"] * calib.per_row("forward", train_b)  # a KL term's no-grad forwards
    decode_reward = pred["images"] * calib.decode_reward_s_per_image
    return {
        "rollout_forward_s": rollout,
        "train_fwd_bwd_s": train,
        "reference_forward_s": reference,
        "decode_reward_s": decode_reward,
        "total_s": rollout + train + reference + decode_reward,
        "rollout_batch": rollout_b,
        "train_batch": train_b,
    }
