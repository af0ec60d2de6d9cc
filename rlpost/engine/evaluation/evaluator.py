"""Held-out evaluation of a run: fixed prompts and seeds, deterministic ODE sampling, the rewards and second judges.

:class:`Evaluator` holds one run's evaluation (its sets loaded, its scorers set up, the reward-hacking alarm's
history); :func:`run` is what the runner calls: it evaluates with the published (EMA) weights, hands metrics and grids
to the trackers and leaves the metrics in the run's stash (:data:`~rlpost.engine.evaluation.keys.LAST_EVAL`).

With ``eval.alarm.enabled`` every evaluation also feeds the reward-hacking detector
(:mod:`rlpost.engine.evaluation.alarm`): the trained rewards on the evaluation images, the judges and image statistics,
pooled over the sets. Its record goes into the evaluation's ``eval.jsonl`` line (``"alarm"``), its ``alarm/*`` metrics
to the trackers, and :attr:`Evaluator.stop_requested` tells the runner to stop when it fired with ``stop: true``.

Results go to ``eval.jsonl`` and ``eval.md`` (:mod:`~rlpost.engine.evaluation.records`) and captioned grids
``eval/step_N.png`` (``eval/<set>/step_N.png`` with sets; :mod:`~rlpost.engine.evaluation.grids`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlpost.core.api import Policy, RewardSource
from rlpost.core.context import RunContext
from rlpost.core.plugins import PluginHost
from rlpost.engine.evaluation.alarm import RewardHackingAlarm
from rlpost.engine.evaluation.config import EvalSpec
from rlpost.engine.evaluation.grids import log_grids, save_set_images
from rlpost.engine.evaluation.judges import score_set
from rlpost.engine.evaluation.keys import JUDGE, LAST_EVAL, image_dir
from rlpost.engine.evaluation.prompt_sets import PromptItems, load_sets
from rlpost.engine.evaluation.records import append_record, eval_record
from rlpost.engine.evaluation.sampler import ode_sample
from rlpost.engine.logging_ import MetricsLogger
from rlpost.engine.phases import PhaseTimer
from rlpost.engine.scoring import set_up_rewards
from rlpost.ops.media import FrameReduction, stack_frames

__all__ = ["Evaluator", "run"]

SetResult = tuple[Tensor, dict[str, list[float]]]
"""One set's ``[N, F, H, W, 3]`` media and per-sample scores by column."""


class Evaluator:
    """Runs held-out evaluations for one run.

    Args:
        spec: The ``eval`` section.
        policy: The policy (the caller swaps EMA weights in when enabled: :func:`run`'s ``weights``).
        output_dir: The run directory.
        frame_reduction: How image rewards and judges score a video's frames (the recipe's
            ``reward_frames.reduction``, as in training; :mod:`rlpost.ops.media`).
    """

    def __init__(
        self, spec: EvalSpec, policy: Policy, output_dir: Path, frame_reduction: FrameReduction = "mean"
    ) -> None:
        self.spec = spec
        self.frame_reduction: FrameReduction = frame_reduction
        self.policy = policy
        self.output_dir = output_dir
        self.items: dict[str, PromptItems] = {}
        self.alarm: RewardHackingAlarm | None = None
        if spec.alarm is not None and spec.alarm.enabled:
            watched = [r.name for r in spec.rewards if r.name in spec.trained]
            self.alarm = RewardHackingAlarm(spec.alarm, watched=watched, judges=[j.name for j in spec.judges])

    @property
    def stop_requested(self) -> bool:
        """The reward-hacking alarm fired and ``eval.alarm.stop`` is set: the run should end."""
        return self.alarm is not None and self.alarm.stop_requested

    @property
    def prompts(self) -> list[str]:
        """Every evaluation prompt, set after set (empty before :meth:`setup`)."""
        return [p for items in self.items.values() for p, _ in items]

    def setup(self, device: torch.device, host: PluginHost, already_set_up: Sequence[RewardSource] = ()) -> None:
        """Load every set's prompts and set up the evaluation rewards and judges not shared with training.

        Args:
            device: Where the rewards and judges run.
            host: The plugin host, to name the plugin of a reward or judge whose set-up fails.
            already_set_up: Sources the training loop set up already (the same objects are not set up twice).

        Raises:
            ValueError: When a prompt source returns no prompts (naming its field).
            PluginRuntimeError: A reward's or judge's set-up raised (:func:`rlpost.engine.scoring.set_up_rewards`).
        """
        self.items = load_sets(self.spec.sets)
        pending = [r for r in [*self.spec.rewards, *self.spec.judges] if not any(r is done for done in already_set_up)]
        set_up_rewards(pending, device, host)

    def due(self, step: int, max_steps: int) -> bool:
        """Whether to evaluate after ``step`` completed steps (step 0, every ``every``, and the last step)."""
        every = self.spec.settings.every
        return step == 0 or step == max_steps or (every > 0 and step % every == 0)

    def evaluate(self, step: int, is_main: bool = True) -> dict[str, float]:
        """Sample every set's prompts, score them with every evaluation reward and judge, write the results.

        Returns:
            Means per set and scorer (:func:`~rlpost.engine.evaluation.keys.metric_key`) and ``perf/eval_sec``.
        """
        t0 = time.perf_counter()
        s = self.spec.settings
        self.policy.train(False)  # update rules switch train mode on for their own passes
        metrics: dict[str, float] = {}
        results: dict[str, SetResult] = {}
        for name, items in self.items.items():
            prompts = [p for p, _ in items]
            meta = [dict(m) for _, m in items]
            seeds = [s.seed + i for i in range(len(prompts))]
            media = ode_sample(self.policy, prompts, seeds, s.num_steps, s.batch_size)
            scores, set_metrics = score_set(
                self.spec, name, media, prompts, meta, self.policy.device, self.frame_reduction
            )
            metrics |= set_metrics
            results[name] = (media, scores)
        alarm = self._observe_alarm(step, results)
        if alarm is not None:
            metrics |= RewardHackingAlarm.metrics(alarm)
        metrics["perf/eval_sec"] = time.perf_counter() - t0
        if is_main:
            self._write(step, results, metrics, alarm)
        return metrics

    def _observe_alarm(self, step: int, results: dict[str, SetResult]) -> dict[str, Any] | None:
        """Feed the alarm this evaluation pooled over the sets (scores by reward/judge name, images, prompt groups)."""
        if self.alarm is None:
            return None
        pooled: dict[str, list[float]] = {}
        for _, scores in results.values():
            for column, values in scores.items():
                pooled.setdefault(column.removeprefix(f"{JUDGE}/"), []).extend(values)
        # A video sample is its frames stacked top to bottom (one-frame media: the images themselves).
        images = torch.cat([stack_frames(media) for media, _ in results.values()])
        groups = [(name, p) for name, items in self.items.items() for p, _ in items]
        return self.alarm.observe(step, pooled, images, groups)

    def _write(
        self, step: int, results: dict[str, SetResult], metrics: dict[str, float], alarm: dict[str, Any] | None
    ) -> None:
        """Grids and per-image PNGs of every set, then the ``eval.jsonl`` line and the ``eval.md`` tables."""
        prompts = {name: [p for p, _ in self.items[name]] for name in results}
        for name, (images, scores) in results.items():
            directory = image_dir(self.output_dir, name, step)
            save_set_images(images, prompts[name], scores, directory, self.spec.settings.save_images)
        scores_by_set = {name: scores for name, (_, scores) in results.items()}
        record = eval_record(step, self.spec, prompts, scores_by_set, metrics, alarm, frames=self.policy.frames)
        append_record(self.output_dir, record)


def run(
    evaluator: Evaluator | None,
    ctx: RunContext,
    *,
    weights: AbstractContextManager[None] | None = None,
    logger: MetricsLogger | None = None,
    phases: PhaseTimer | None = None,
) -> dict[str, float]:
    """One held-out evaluation of a run at ``ctx.step``, as the runner does it: inside ``weights`` (the published
    weights: the runner passes ``rlpost.engine.persistence.published_weights``, which swaps the EMA weights in when the
    run keeps them; every rank takes part), timed as the ``eval`` phase of ``phases``, its metrics and grids handed to
    the trackers of ``logger`` (main process) and its metrics left in ``ctx.stash[LAST_EVAL]`` (the progress line
    shows the alarm).

    Returns:
        The evaluation's metrics; empty without an ``eval`` section (``evaluator`` is ``None``).
    """
    if evaluator is None:
        return {}
    timed = phases.timed("eval") if phases is not None else contextlib.nullcontext()
    with timed, weights if weights is not None else contextlib.nullcontext():
        metrics = evaluator.evaluate(ctx.step, ctx.is_main_process)
    if logger is not None:
        logger.log_trackers(ctx.step, metrics)
        log_grids(logger, evaluator.output_dir, evaluator.spec.sets, ctx.step)
    ctx.stash[LAST_EVAL] = metrics
    return metrics
