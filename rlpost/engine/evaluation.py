"""Held-out evaluation: fixed prompts and seeds, deterministic ODE sampling, the training rewards and second judges.

Recipe section ``eval`` (all optional except ``prompts`` or ``sets``)::

    eval:
      prompts: {class_path: prompt-list, init_args: {prompts: [...]}}   # one PromptSource, or instead:
      sets:                                                             # several named ones, reported separately
        heldout: {class_path: digit-prompts, init_args: {split: eval}}
        pretrain: {class_path: digit-prompts, init_args: {split: pretrain}}
      rewards: [{class_path: jpeg-compressibility}, {class_path: clipscore}]  # default: the training rewards
      judges: [{class_path: digit-judge}]  # second judges: scored here only, never trained on
      num_steps: 20      # Euler ODE steps (NFE per image, before CFG doubling)
      every: 50          # also evaluated at step 0 (the "before" reference) and at the end; 0 = only those two
      seed: 1234         # prompt i of each set uses torch.Generator().manual_seed(seed + i)
      batch_size: 8
      save_images: true  # per-image PNGs (``eval/step_N/0000.png``, ``eval/<set>/step_N/0000.png``) besides the grid
      alarm: {enabled: true, window: 3, judge_drop: 0.1, stat_drift: 0.08, stop: false}  # rlpost.engine.alarm

Metric names (:func:`metric_key`): ``eval/<reward>`` and ``eval/judge/<judge>`` for a single ``prompts`` source;
``eval/<set>/<reward>`` and ``eval/<set>/judge/<judge>`` with ``sets``. Judges are scorers the policy never optimised
(the recipe rejects a judge that is also a training reward): a training reward that rises while the judges stay flat
is reward hacking, not a better model. They live only in this section, so nothing in the training step (rewards,
advantages, updates) ever sees them.

With ``alarm.enabled`` every evaluation also feeds the reward-hacking detector (:mod:`rlpost.engine.alarm`): the trained
rewards on the evaluation images, the judges and image statistics, pooled over the sets. Its record goes into the
evaluation's ``eval.jsonl`` line (``"alarm"``), its ``alarm/*`` metrics to the trackers, and
:attr:`Evaluator.stop_requested` tells the runner to stop when it fired with ``stop: true``.

Results go to ``eval.jsonl`` (one line per evaluation: means and per-prompt scores), ``eval.md`` (markdown tables,
one per set, regenerated each time) and captioned grids ``eval/step_N.png`` (``eval/<set>/step_N.png`` with sets).
The sampler here is deliberately tiny and shared with ``rlpost sample``: initial noise from the policy, then
``EulerODE`` steps along ``policy.sigmas``, then decode, which is what ``StableDiffusion3Pipeline.__call__`` does for
the SD3 adapter on its default grid. ``policy.sigmas`` is the run's one time grid (``model.init_args.time_grid``,
``docs/models.md`` "Time grids"), so evaluation steps through the same noise levels as the training samplers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlpost.core.api import Policy, PromptSource, RewardSource
from rlpost.core.contract import StashKey
from rlpost.engine.alarm import AlarmConfig, RewardHackingAlarm
from rlpost.engine.rundir import json_safe
from rlpost.ops.images import save_grid, save_images
from rlpost.ops.kernels import EulerODE

__all__ = [
    "GRID_MAX_IMAGES",
    "JUDGE",
    "LAST_EVAL",
    "SET_NAME_RE",
    "EvalSettings",
    "EvalSpec",
    "Evaluator",
    "eval_columns",
    "eval_sets",
    "image_dir",
    "markdown_table",
    "metric_key",
    "ode_sample",
    "read_evals",
    "write_table",
]

JUDGE = "judge"
"""Marks a second judge's metric (``eval/<set>/judge/<name>``) and per-prompt score (``judge/<name>``)."""
GRID_MAX_IMAGES = 64
"""Most images in one ``eval/[<set>/]step_N.png`` grid (spread over the set); per-image PNGs keep every image."""
LAST_EVAL: StashKey[dict[str, float]] = StashKey("rlpost.last_eval")
"""The latest evaluation's metrics in the run's stash (set by the runner; the progress line shows the alarm)."""
SET_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
"""Allowed evaluation set names (they become metric path segments and directory names)."""


def metric_key(set_name: str, scorer: str, judge: bool = False) -> str:
    """``eval/[<set>/][judge/]<scorer>``; ``set_name`` is ``""`` for a single unnamed ``eval.prompts`` source."""
    return "/".join(["eval", *([set_name] if set_name else []), *([JUDGE] if judge else []), scorer])


def image_dir(output_dir: Path, set_name: str, step: int) -> Path:
    """Where one evaluation's per-image PNGs go: ``eval/step_N`` or, for a named set, ``eval/<set>/step_N``."""
    base = output_dir / "eval"
    return (base / set_name if set_name else base) / f"step_{step:06d}"


@dataclass
class EvalSettings:
    """Scalar settings of the ``eval`` recipe section (type-checked by jsonargparse)."""

    num_steps: int = 20
    every: int = 0
    seed: int = 1234
    batch_size: int = 8
    save_images: bool = True

    def problems(self) -> list[str]:
        """Range problems, each naming its field relative to the section (the recipe prefixes ``eval.``)."""
        problems = [
            f"{n}: must be >= 1, got {getattr(self, n)}" for n in ("num_steps", "batch_size") if getattr(self, n) < 1
        ]
        if self.every < 0:
            problems.append(f"every: must be >= 0, got {self.every}")
        return problems


@dataclass
class EvalSpec:
    """The validated ``eval`` section: components plus settings.

    Attributes:
        sets: Evaluation prompt sources by name, in recipe order. A recipe's single ``eval.prompts`` source is the
            one unnamed set ``""`` (its metrics keep the short names ``eval/<reward>``).
        rewards: Evaluation rewards (may include ones not trained on); shared instances with training rewards
            whose resolved configuration is identical, so their weights load once.
        judges: Second judges: never training rewards, scored and logged next to ``rewards``.
        settings: NFE, interval, seed, batch size.
        alarm: The reward-hacking alarm's settings (``eval.alarm``), or ``None``.
        trained: Names of the evaluation rewards that are also training rewards (the ones the alarm watches).
    """

    sets: dict[str, PromptSource]
    rewards: list[RewardSource]
    judges: list[RewardSource] = field(default_factory=list)
    settings: EvalSettings = field(default_factory=EvalSettings)
    alarm: AlarmConfig | None = None
    trained: list[str] = field(default_factory=list)


@torch.no_grad()
def ode_sample(policy: Policy, prompts: Sequence[str], seeds: Sequence[int], num_steps: int, batch_size: int) -> Tensor:
    """Deterministic Euler-ODE samples, one per ``(prompt, seed)``, as ``[N, H, W, 3]`` uint8 on the CPU.

    Each image's initial noise comes from its own CPU generator seeded with its seed, so results do not depend on
    ``batch_size`` or on the device (diffusers' ``generator=torch.Generator().manual_seed(seed)`` convention).
    """
    kernel = EulerODE()
    sigmas = policy.sigmas(num_steps)
    out: list[Tensor] = []
    for start in range(0, len(prompts), batch_size):
        chunk = list(prompts[start : start + batch_size])
        noise = [
            policy.initial_noise(1, torch.Generator().manual_seed(int(s))) for s in seeds[start : start + batch_size]
        ]
        x = torch.cat(noise).to(policy.device)
        cond = policy.encode(chunk)
        n = x.shape[0]
        for i in range(num_steps):
            s, s_next = sigmas[i].expand(n), sigmas[i + 1].expand(n)
            x = kernel.step(x, policy.velocity(x, s, cond), s, s_next, None).next_latents
        out.append(policy.decode(x).cpu())
    return torch.cat(out)


class Evaluator:
    """Runs held-out evaluations for one run.

    Args:
        spec: The ``eval`` section.
        policy: The policy (EMA weights are swapped in by the caller when enabled).
        output_dir: The run directory.
    """

    JSONL = "eval.jsonl"
    TABLE = "eval.md"

    def __init__(self, spec: EvalSpec, policy: Policy, output_dir: Path) -> None:
        self.spec = spec
        self.policy = policy
        self.output_dir = output_dir
        self.items: dict[str, list[tuple[str, dict[str, Any]]]] = {}
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

    def setup(self, device: torch.device, already_set_up: Sequence[RewardSource] = ()) -> None:
        """Load every set's prompts and set up the evaluation rewards and judges not shared with training.

        Raises:
            ValueError: When a prompt source returns no prompts (naming its field).
        """
        self.items = {}
        for name, source in self.spec.sets.items():
            items = [(p, dict(m)) for p, m in source.load()]
            if not items:
                where = f"eval.sets.{name}" if name else "eval.prompts"
                raise ValueError(f"{where}: the held-out prompt source returned no prompts")
            self.items[name] = items
        for reward in [*self.spec.rewards, *self.spec.judges]:
            if not any(reward is r for r in already_set_up):
                reward.setup(device)

    def due(self, step: int, max_steps: int) -> bool:
        """Whether to evaluate after ``step`` completed steps (step 0, every ``every``, and the last step)."""
        every = self.spec.settings.every
        return step == 0 or step == max_steps or (every > 0 and step % every == 0)

    def evaluate(self, step: int, is_main: bool = True) -> dict[str, float]:
        """Sample every set's prompts, score them with every evaluation reward and judge, write the results.

        Returns:
            Means per set and scorer (:func:`metric_key`) and ``perf/eval_sec``.
        """
        import time

        t0 = time.perf_counter()
        s = self.spec.settings
        self.policy.train(False)  # update rules switch train mode on for their own passes
        metrics: dict[str, float] = {}
        results: dict[str, tuple[Tensor, dict[str, list[float]]]] = {}
        scorers = [(r, r.name) for r in self.spec.rewards] + [(j, f"{JUDGE}/{j.name}") for j in self.spec.judges]
        for name, items in self.items.items():
            prompts = [p for p, _ in items]
            meta = [dict(m) for _, m in items]
            seeds = [s.seed + i for i in range(len(prompts))]
            images = ode_sample(self.policy, prompts, seeds, s.num_steps, s.batch_size)
            scores: dict[str, list[float]] = {}
            for scorer, column in scorers:
                values = scorer.score(images.to(self.policy.device), list(prompts), meta).float().cpu()
                scores[column] = [float(v) for v in values]
            for reward in self.spec.rewards:
                metrics[metric_key(name, reward.name)] = _mean(scores[reward.name])
            for judge in self.spec.judges:
                metrics[metric_key(name, judge.name, judge=True)] = _mean(scores[f"{JUDGE}/{judge.name}"])
            results[name] = (images, scores)
        alarm = self._observe_alarm(step, results)
        if alarm is not None:
            metrics |= RewardHackingAlarm.metrics(alarm)
        metrics["perf/eval_sec"] = time.perf_counter() - t0
        if is_main:
            self._write(step, results, metrics, alarm)
        return metrics

    def _observe_alarm(
        self, step: int, results: dict[str, tuple[Tensor, dict[str, list[float]]]]
    ) -> dict[str, Any] | None:
        """Feed the alarm this evaluation pooled over the sets (scores by reward/judge name, images, prompt groups)."""
        if self.alarm is None:
            return None
        pooled: dict[str, list[float]] = {}
        for _, scores in results.values():
            for column, values in scores.items():
                pooled.setdefault(column.removeprefix(f"{JUDGE}/"), []).extend(values)
        images = torch.cat([images for images, _ in results.values()])
        groups = [(name, p) for name, items in self.items.items() for p, _ in items]
        return self.alarm.observe(step, pooled, images, groups)

    def _write(
        self,
        step: int,
        results: dict[str, tuple[Tensor, dict[str, list[float]]]],
        metrics: dict[str, float],
        alarm: dict[str, Any] | None = None,
    ) -> None:
        seed = self.spec.settings.seed
        per_prompt: list[dict[str, Any]] = []
        for name, (images, scores) in results.items():
            prompts = [p for p, _ in self.items[name]]
            for i, p in enumerate(prompts):
                per_prompt.append(
                    {**({"set": name} if name else {}), "prompt": p, "seed": seed + i}
                    | {column: v[i] for column, v in scores.items()}
                )
            # A benchmark-sized set (thousands of prompts) would make a grid of gigapixels: show a spread subset.
            n = len(prompts)
            g = GRID_MAX_IMAGES
            shown = list(range(n)) if n <= g else [i * (n - 1) // (g - 1) for i in range(g)]
            captions = [
                f"{prompts[i]} | " + " ".join(f"{column}={v[i]:.3g}" for column, v in scores.items()) for i in shown
            ]
            directory = image_dir(self.output_dir, name, step)
            save_grid(images[shown], captions, directory.with_suffix(".png"))
            if self.spec.settings.save_images:
                save_images(images, directory)
        record = {
            "step": step,
            "num_steps": self.spec.settings.num_steps,
            **({"sets": list(results)} if any(results) else {}),
            **({"judges": [j.name for j in self.spec.judges]} if self.spec.judges else {}),
            **{k: v for k, v in metrics.items() if k.startswith("eval/")},
            "eval_sec": round(metrics["perf/eval_sec"], 3),  # sampling + scoring, so a run's eval share is visible
            **({"alarm": alarm} if alarm is not None else {}),
            "per_prompt": per_prompt,
        }
        with (self.output_dir / self.JSONL).open("a") as fh:
            fh.write(json.dumps(json_safe(record)) + "\n")
        write_table(self.output_dir)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def read_evals(output_dir: Path) -> list[dict[str, Any]]:
    """Records of ``eval.jsonl`` (empty when absent)."""
    path = output_dir / Evaluator.JSONL
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def eval_sets(records: Sequence[dict[str, Any]]) -> list[str]:
    """The evaluation set names of these records, in recipe order; ``[""]`` for a single unnamed prompt source."""
    names: list[str] = []
    for r in records:
        names += [n for n in r.get("sets", []) if isinstance(n, str) and n not in names]
    return names or [""]


def eval_columns(records: Sequence[dict[str, Any]], set_name: str) -> list[str]:
    """Metric keys of one set: its rewards (sorted), then its judges (sorted)."""
    prefix = metric_key(set_name, "")
    keys = {k for r in records for k in r if k.startswith(prefix)}
    judge = metric_key(set_name, "", judge=True)
    return sorted(keys, key=lambda k: (k.startswith(judge), k))


def markdown_table(records: list[dict[str, Any]]) -> str:
    """Markdown tables: per evaluation set, one row per evaluation and one column per reward and judge."""
    if not records:
        return "_no held-out evaluation recorded_\n"
    parts: list[str] = []
    if any(r.get("judges") for r in records):
        parts.append("Columns `judge/<name>` are second judges: scored here, never trained on.\n")
    for name in eval_sets(records):
        keys = eval_columns(records, name)
        prefix = metric_key(name, "")
        lines = [f"## {name}\n"] if name else []
        lines.append("| step | " + " | ".join(k.removeprefix(prefix) for k in keys) + " |")
        lines.append("|---:|" + "---:|" * len(keys))
        for r in records:
            cells = [f"{r[k]:.4f}" if isinstance(r.get(k), (int, float)) else "" for k in keys]
            lines.append(f"| {r['step']} | " + " | ".join(cells) + " |")
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)


def write_table(output_dir: Path) -> None:
    """Regenerate ``eval.md`` from ``eval.jsonl``."""
    (output_dir / Evaluator.TABLE).write_text("# Held-out evaluation\n\n" + markdown_table(read_evals(output_dir)))
