"""The online RL loop: prompts -> rollout -> rewards -> advantages -> policy update -> hooks.

There is no algorithm name in this file: what varies between TreeGRPO, DanceGRPO, MixGRPO and DDPO lives in the
sampler, advantage estimator and update rule the recipe chose. Around the loop: non-finite guards
(:mod:`rlpost.engine.guards`), periodic held-out evaluation (:mod:`rlpost.engine.evaluation`), atomic checkpoints and
exact resume (:mod:`rlpost.engine.checkpoint`, the run's state in and out of them in :mod:`rlpost.engine.persistence`),
optional EMA (:mod:`rlpost.engine.ema`) and metric sinks (:mod:`rlpost.engine.logging_`).
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlpost.components.prompt_selection import SpreadFilter
from rlpost.components.prompts import PromptStream
from rlpost.core.api import LIVE, Advantages, UpdateContext, update_result_problems
from rlpost.core.context import RunContext, RunStatus
from rlpost.core.contract import RewardScores, Rollout
from rlpost.core.plugin_errors import PluginRuntimeError
from rlpost.core.plugins import PluginHost
from rlpost.engine import evaluation, lr_schedule, persistence
from rlpost.engine.backend import EngineBackend, LocalBackend, resolve_device
from rlpost.engine.checkpoint import CheckpointError, CheckpointInfo, RunFinishedError
from rlpost.engine.distributed import DeepSpeedBackend, World
from rlpost.engine.ema import EMA
from rlpost.engine.evaluation import Evaluator
from rlpost.engine.guards import Guards
from rlpost.engine.logging_ import MetricsLogger
from rlpost.engine.overlap import sample_and_score
from rlpost.engine.persistence import RunState
from rlpost.engine.phases import PhaseTimer
from rlpost.engine.ratio_guard import SpeedupCheck, check_speedups
from rlpost.engine.recipe import Recipe, RecipeError
from rlpost.engine.rundir import RunDirectory
from rlpost.engine.scoring import score_rollout, set_up_rewards
from rlpost.engine.sharding import (
    STREAM_MINIBATCH,
    STREAM_ROLLOUT,
    GroupSharding,
    LocalSharding,
    UpdateTotals,
    stream_generator,
)
from rlpost.engine.step_metrics import save_step_grid, step_metrics
from rlpost.engine.weight_copies import EngineCopies
from rlpost.models.acceleration import apply_acceleration

__all__ = ["Runner"]


class Runner:
    """Drives a recipe's components through ``run.max_steps`` training steps.

    :meth:`run` is the whole life of a run; a driver that schedules steps itself (``rlpost bench`` interleaves
    several runners) uses the same pieces: :meth:`begin`, then :meth:`step` (and :meth:`evaluate`,
    :meth:`save_checkpoint`) as it sees fit, then :meth:`finish` with the final status, also on failure.

    Args:
        recipe: A validated recipe (see :func:`rlpost.engine.recipe.load_recipe`).
        host: The plugin host whose lifecycle hooks are called.
        resume: ``None`` for a new run; ``"latest"``, a run directory or a checkpoint directory to continue one.
    """

    def __init__(self, recipe: Recipe, host: PluginHost, resume: str | None = None) -> None:
        self.recipe = recipe
        self.host = host
        self.resume = resume
        self.device = resolve_device(recipe.run.device)
        self.rundir = RunDirectory(Path(recipe.run.output_dir))
        self.ctx = RunContext(recipe=recipe, output_dir=self.rundir.path)
        self.seed = recipe.run.seed
        self.rollout_gen = stream_generator(self.seed, STREAM_ROLLOUT)
        self.minibatch_gen = stream_generator(self.seed, STREAM_MINIBATCH)
        self.stream: PromptStream | None = None
        self.backend: EngineBackend | None = None
        self.world: World | None = None
        self.shard: LocalSharding | GroupSharding = LocalSharding(self.seed, self.rollout_gen, self.minibatch_gen)
        self.guards = Guards(recipe.guards)
        self.ema: EMA | None = None
        self.copies: EngineCopies | None = None
        """The named weight copies (recipe section ``copies``, :mod:`rlpost.engine.weight_copies`), built by setup."""
        self.evaluator: Evaluator | None = None
        self.logger: MetricsLogger | None = None
        self.last_saved_step = -1
        self.last_update: UpdateTotals | None = None
        """The last step's update (its typed counts; ``None`` when the guards skipped it), for drivers such as the
        bench that account for its cost."""
        self.status: RunStatus | None = None  # the final status finish() recorded
        self._state: RunState | None = None  # the parts checkpoints save and restore, built once by setup()
        self.phases = PhaseTimer()
        """Wall time of each step phase, of loading, evaluations and checkpoints (:mod:`rlpost.engine.phases`)."""
        self.ratio_check: SpeedupCheck | None = None
        """What the speed-up guard measured at set-up (:mod:`rlpost.engine.ratio_guard`: a ``RatioCheck`` for a rule
        requiring edge-log-probs, else a ``LossCheck``); ``None`` without speed-ups."""

    # ------------------------------------------------------------------------------------------------ set-up

    def setup(self) -> None:
        """Create (or reopen, when resuming) the run directory, load weights, build the torch optimizer, the prompt
        stream, EMA, evaluator and trackers; then restore the checkpoint when resuming (``--resume latest`` without
        one restarts from step 0, :mod:`rlpost.engine.rundir`). With ``run.speedups`` on, the speed-ups are applied
        after the model loads and the ratio guard runs last.

        Raises:
            CheckpointError: The resume cannot be honoured (checked before any weights load) or the run directory
                cannot be written; ``FileExistsError``: a new run's directory holds a run that trained.
            RunFinishedError: The resumed checkpoint already reached ``run.max_steps`` (before any weights load).
            RecipeError: The model or a reward cannot read its files (e.g. corrupt weights, named by the loader).
            SpeedupRatioError: The speed-ups change the importance ratio beyond ``run.speedups.ratio_tolerance``.
        """
        r = self.recipe
        checkpoint: CheckpointInfo | None = None
        if self.resume is not None:  # continues the checkpoint's own run directory and seed (None: restart from 0)
            checkpoint, run_dir, self.seed = persistence.check_resume(
                self.resume, self.rundir.path, r.config, self.seed
            )
            self.rundir, self.ctx.output_dir, self.shard.seed = RunDirectory(run_dir), run_dir, self.seed
            if checkpoint is not None and checkpoint.step >= r.run.max_steps:
                raise RunFinishedError(checkpoint.path, checkpoint.step, r.run.max_steps)
        if r.distributed is not None:
            self._start_world()
        earlier = False  # an attempt without a checkpoint had logged here (a resume without one restarts it)
        if checkpoint is None and self.ctx.is_main_process:
            earlier = self.rundir.create(r.config, self.host.plugins(include_builtin=True), self.resume is not None)
        self.shard.barrier()  # rank 0 created the run directory
        # The global RNGs drive weight initialisation (e.g. LoRA's A matrices) and dropout: seed them so two runs of
        # one recipe start from the same weights (a resume then restores their saved states).
        torch.manual_seed(self.seed)
        random.seed(self.seed)
        np.random.seed(self.seed % 2**32)
        try:  # unreadable or corrupt weights (the loaders name the file) are a bad input, not a bug
            with self.phases.timed("load"):
                r.model.setup(self.device)
                apply_acceleration(r.model, r.run.speedups)
                set_up_rewards(r.rewards, self.device, self.host)
        except OSError as exc:
            raise RecipeError([str(exc)]) from None
        params = r.model.trainable_parameters()
        optimizer = r.torch_optimizer(params)
        scheduler = r.lr_scheduler(optimizer) if r.lr_scheduler is not None else None
        if r.distributed is not None and self.world is not None:
            from rlpost.engine.distributed import policy_module

            self.backend = DeepSpeedBackend(
                policy_module(r.model), params, optimizer, scheduler, r.run.max_grad_norm, r.distributed, self.world
            )
            if isinstance(self.shard, GroupSharding):
                self.shard.backend = self.backend
        else:
            self.backend = LocalBackend(params, optimizer, scheduler, r.run.max_grad_norm)
        selector = SpreadFilter(r.run.min_group_spread, r.run.max_skips) if r.run.min_group_spread else None
        self.stream = stream = PromptStream(r.prompts.load(), seed=self.seed, selector=selector)
        if r.ema is not None:  # under ZeRO the EMA keeps only this rank's share of the weights
            self.ema = EMA(params, r.ema, self.backend.weight_shards())
        self.copies = EngineCopies(r.model, params, r.copies or {}, self.backend.weight_shards())
        if r.eval is not None:
            self.evaluator = Evaluator(r.eval, r.model, self.rundir.path, r.reward_frames.reduction)
            self.evaluator.setup(self.device, self.host, already_set_up=r.rewards)
        if self.ctx.is_main_process:
            # A start over an earlier attempt logs step 0 again: TensorBoard hides that attempt's events from 0 on.
            resumed = checkpoint.step if checkpoint is not None else (-1 if earlier else None)
            self.logger = MetricsLogger(self.rundir, r.logging, self.rundir.path.name, r.config, resumed)
        self._state = RunState(
            recipe=r,
            host=self.host,
            ctx=self.ctx,
            seed=self.seed,
            rollout_gen=self.rollout_gen,
            minibatch_gen=self.minibatch_gen,
            stream=stream,
            backend=self.backend,
            guards=self.guards,
            ema=self.ema,
            copies=self.copies,
            rundir=self.rundir,
            barrier=self.shard.barrier,
        )
        if checkpoint is not None:
            self.load_checkpoint(checkpoint)
        self.ratio_check = check_speedups(r, stream, self.seed, self.ctx.step, self.shard.max_over_ranks, self.copies)

    def _start_world(self) -> None:
        """Join the process group; this rank's device, rank and the group-aware work split follow from it."""
        from rlpost.engine.distributed import init_world

        assert self.recipe.distributed is not None
        self.world = world = init_world(self.recipe.distributed, self.recipe.run.device)
        self.device = world.device
        self.ctx.rank, self.ctx.world_size = world.rank, world.world_size
        self.shard = GroupSharding(self.seed, world.rank, world.world_size, world.all_gather, world.barrier)

    # ------------------------------------------------------------------------------------------------- steps

    def score(self, rollout: Rollout) -> RewardScores:
        """Score the rollout's samples with every reward source (:func:`rlpost.engine.scoring.score_rollout`);
        failed or non-finite scores are recorded by the guards."""
        r = self.recipe
        return score_rollout(
            r.rewards, dict(r.reward_weights), rollout, self.guards, self.host, r.reward_frames.reduction
        )

    def step(self) -> dict[str, float]:
        """One training step; returns its metrics (identical on every rank). Each phase is timed in
        :attr:`phases` (:mod:`rlpost.engine.phases`)."""
        assert self.stream is not None and self.backend is not None, "call setup() first"
        r, shard, timed = self.recipe, self.shard, self.phases.timed
        self.phases.start_step()
        self.guards.begin_step()
        lr_schedule.begin_step(self.backend.scheduler, self.ctx.step, r.run.max_steps)  # a schedule over the run
        r.sampler.begin_run_step(self.ctx.step, r.run.max_steps)
        rollout, scores = self._sample_and_score()  # each rank samples and scores its own groups
        view = shard.gather(rollout, scores, self.guards)  # whole groups of every rank (the rollout itself locally)
        self.stream.observe(view.rollout, view.scores)  # identical on every rank (run.min_group_spread)
        adv_metrics: dict[str, float] = {}
        update: UpdateTotals | None = None
        if not self.guards.tripped:  # a non-finite reward poisons its group's advantages: skip the update
            with timed("advantage"):
                advantages = view.local(self._guard_advantages(r.advantage.estimate(view.rollout, view.scores)))
            self.host.after_advantages(self.ctx, rollout, advantages)
            adv_metrics, gen = advantages.metrics, shard.minibatch_generator(self.ctx.step)
            with timed("update"):
                ctx = UpdateContext(
                    r.model, r.sampler, rollout, advantages, self.backend, gen, self.ctx.step, self.copies, self.seed
                )
                update = shard.reduce(self._update(ctx))
            self._guard_update(update)
        self.last_update = update
        metrics = step_metrics(view.rollout, view.scores, adv_metrics, update, self.phases, self.ratio_check)
        metrics |= self.guards.metrics()
        metrics |= self.stream.metrics()
        slowest = shard.max_over_ranks(metrics["perf/step_sec"])  # a collective: every rank gets the same seconds
        lr_schedule.end_step(self.backend.scheduler, slowest)
        r.sampler.end_run_step(slowest)
        self.ctx.step += 1
        assert self.copies is not None
        metrics |= self.copies.update(self.ctx.step)
        self.ctx.history.append(metrics)
        if self.ema is not None:
            self.ema.update(self.ctx.step)
        if self.logger is not None and self.ctx.step % r.run.log_every == 0:
            self.logger.log(self.ctx.step, metrics)
        self._maybe_grid(rollout, scores)
        self.host.after_step(self.ctx, metrics)
        if self.guards.should_stop():
            self._stop_on_guard()
        return metrics

    def _sample_and_score(self) -> tuple[Rollout, RewardScores]:
        """The step's rollout (phase ``rollout``) and reward scores (phase ``reward``), with the hooks after each; with
        ``run.speedups.overlap_groups`` sampled in parts, each scored while the next samples
        (:mod:`rlpost.engine.overlap`), both in phase ``rollout``."""
        r, shard, timed, step = self.recipe, self.shard, self.phases.timed, self.ctx.step
        assert self.stream is not None and self.copies is not None
        parts = r.run.speedups.overlap_groups
        weights = r.optimizer.rollout_copy(step) or LIVE  # e.g. DiffusionNFT samples with its "old" copy
        with timed("rollout"):
            batch = shard.next_batch(self.stream, r.run.groups_per_step, r.run.samples_per_group)
            with torch.no_grad(), self.copies.use(weights):
                if parts:
                    rollout, scores = sample_and_score(
                        shard.rollout_parts(r.sampler, r.model, batch, step, parts), self.score
                    )
                else:
                    rollout = shard.rollout(r.sampler, r.model, batch, step)
            self._guard_log_probs(rollout)
        self.host.after_rollout(self.ctx, rollout)
        if not parts:
            with timed("reward"):
                scores = self.score(rollout)
        self.host.after_rewards(self.ctx, rollout, scores)
        return rollout, scores

    def _guard_log_probs(self, rollout: Rollout) -> None:
        """Behaviour log-probs of trainable edges must be finite; bad edges are made untrainable."""
        trainable = rollout.trainable
        if not bool(trainable.any()):
            return
        finite = self.guards.finite_mask("logprob", rollout.old_log_probs[trainable], "the sampler's log-probs")
        if not bool(finite.all()):
            idx = torch.nonzero(trainable, as_tuple=False).flatten()
            keep = trainable.clone()
            keep[idx[~finite.to(idx.device)]] = False
            rollout.trainable = keep

    def _guard_advantages(self, advantages: Advantages) -> Advantages:
        """Non-finite advantages, per edge or per sample, become 0 (they contribute no gradient) and are counted."""
        where = f"advantage {self.recipe.advantage.name!r}"
        edges_ok = self.guards.finite_mask("advantage", advantages.edges, where)
        samples_ok = self.guards.finite_mask("advantage", advantages.samples, f"{where} (per sample)")
        if bool(edges_ok.all()) and bool(samples_ok.all()):
            return advantages
        edges = torch.where(edges_ok, advantages.edges, torch.zeros_like(advantages.edges))
        samples = torch.where(samples_ok, advantages.samples, torch.zeros_like(advantages.samples))
        return Advantages(edges=edges, samples=samples, metrics=advantages.metrics)

    def _update(self, ctx: UpdateContext) -> UpdateTotals:
        """The update rule's step, with what the backend counted while it ran.

        Raises:
            PluginRuntimeError: The rule returned anything but a complete :class:`~rlpost.core.api.UpdateResult`
                (the guards and cost accounting would lose their counts), naming its plugin and distribution.
        """
        assert self.backend is not None
        backend, optimizer = self.backend, self.recipe.optimizer
        refused, skipped = backend.refused_losses, backend.skipped_steps
        result = optimizer.update(ctx)
        problems = update_result_problems(result)
        if problems:
            distribution, plugin = self.host.component_origin("optimizer", optimizer)
            where = f"optimizer {optimizer.name!r}"
            raise PluginRuntimeError(distribution, plugin, where, "update(): " + "; ".join(problems))
        return UpdateTotals(result, backend.refused_losses - refused, backend.skipped_steps - skipped)

    def _guard_update(self, update: UpdateTotals) -> None:
        """Non-finite losses never reach the gradients (the rule keeps them from ``backward``, or the backend refuses
        them) and non-finite gradients never reach the weights (the backend skips the step); count both here."""
        self.guards.record("loss", update.nonfinite_losses, "the policy loss")
        self.guards.record("grad", update.nonfinite_grad_steps, "the gradients")

    def _stop_on_guard(self) -> None:
        error = self.guards.error(self.ctx.step)
        try:
            self.save_checkpoint(reason="guard-stop")
        except (CheckpointError, PluginRuntimeError) as exc:
            raise error from exc
        raise error

    def _maybe_grid(self, rollout: Rollout, scores: RewardScores) -> None:
        every = self.recipe.logging.grid_every
        if self.ctx.is_main_process and every > 0 and self.ctx.step % every == 0:
            save_step_grid(self.rundir.path, self.ctx.step, rollout, scores, self.logger)

    # ------------------------------------------------------------------------------------------ state & disk

    def _run_state(self) -> RunState:
        """This run's parts as :mod:`rlpost.engine.persistence` saves and restores them (built once by :meth:`setup`:
        references, so restoring writes into the live objects)."""
        assert self._state is not None, "call setup() first"
        return self._state

    def state(self) -> dict[str, Any]:
        """Everything needed to continue this run except the trainable weights
        (:func:`rlpost.engine.persistence.gather_state`); plugins add theirs through ``rlpost_save_state``."""
        return persistence.gather_state(self._run_state())

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state` returned (after :meth:`setup`); calls ``rlpost_load_state``."""
        persistence.restore_state(self._run_state(), state)

    def save_checkpoint(self, reason: str = "periodic") -> Path | None:
        """Write a checkpoint of the current state (main process) and rotate old ones; returns its directory
        (:func:`rlpost.engine.persistence.save_checkpoint`).

        Raises:
            CheckpointError: The trainable (or EMA) weights are not finite: nothing is written.
        """
        with self.phases.timed("checkpoint"):
            path = persistence.save_checkpoint(self._run_state(), reason)
        if path is not None:
            self.last_saved_step = self.ctx.step
        return path

    def load_checkpoint(self, info: CheckpointInfo) -> None:
        """Restore weights, EMA and state from a checkpoint (after :meth:`setup` built everything)."""
        persistence.load_checkpoint(self._run_state(), info)
        self.last_saved_step = self.ctx.step

    # --------------------------------------------------------------------------------------------------- run

    def evaluate(self) -> dict[str, float]:
        """Held-out evaluation at the current step (EMA weights when enabled; :func:`rlpost.engine.evaluation.run`);
        empty without an ``eval`` section."""
        weights = persistence.published_weights(self.ema, self.backend)
        return evaluation.run(self.evaluator, self.ctx, weights=weights, logger=self.logger, phases=self.phases)

    def _periodic(self) -> None:
        """Evaluation and checkpoints due after the step just completed (also at the last step)."""
        step, r = self.ctx.step, self.recipe
        if self.evaluator is not None and self.evaluator.due(step, r.run.max_steps):
            self.evaluate()
        every, last = r.checkpoint.every, step == r.run.max_steps
        if (every > 0 and step % every == 0) or (last and r.checkpoint.at_end):
            self.save_checkpoint("end" if last else "periodic")

    def begin(self) -> None:
        """Start the run: :meth:`setup`, then ``rlpost_before_run``. Pair with :meth:`finish`."""
        self.setup()
        self.host.before_run(self.ctx)

    def finish(self, status: RunStatus | str) -> None:
        """End the run with ``status`` (a :class:`~rlpost.core.context.RunStatus` or its value): write the summary
        (main process), close the metric sinks and call ``rlpost_after_run``. Call it from a ``finally`` after
        :meth:`begin` succeeded.

        Raises:
            ValueError: ``status`` is no :class:`~rlpost.core.context.RunStatus` value.
            PluginRuntimeError: An ``rlpost_after_run`` implementation failed after a completed run. When the run
                is already failing, that failure is the one to report: the plugin's becomes a warning.
        """
        status = RunStatus(status)
        self.status = status
        if self.ctx.is_main_process:
            self.rundir.write_summary(status.value, self.ctx.step, self.ctx.history)
        if self.logger is not None:
            self.logger.close()
        try:
            self.host.after_run(self.ctx, status)
        except PluginRuntimeError as exc:
            if status is RunStatus.COMPLETED:
                raise
            warnings.warn(f"{exc} (while the run was {status.value})", UserWarning, stacklevel=2)

    def run(self) -> list[dict[str, float]]:
        """:meth:`begin`, evaluate the start, run every step with its periodic evaluations and checkpoints, and
        :meth:`finish` with the final status (also on failure)."""
        self.begin()
        status = RunStatus.FAILED
        try:
            if self.ctx.step == 0 and self.evaluator is not None:
                self.evaluate()  # the "before" reference
            while self.ctx.step < self.recipe.run.max_steps:
                self.step()
                self._periodic()
                # eval.alarm.stop (rlpost.engine.evaluation.alarm): the alarm fired and asked the run to end
                if self.evaluator is not None and self.evaluator.stop_requested:
                    break
            status = RunStatus.STOPPED if self.ctx.step < self.recipe.run.max_steps else RunStatus.COMPLETED
            stopped = status is RunStatus.STOPPED
            if stopped and self.recipe.checkpoint.at_end and self.last_saved_step != self.ctx.step:
                self.save_checkpoint("alarm-stop")
        except KeyboardInterrupt:
            status = RunStatus.INTERRUPTED
            raise
        finally:
            self.finish(status)
        return self.ctx.history
