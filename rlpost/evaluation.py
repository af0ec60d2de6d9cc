"""Held-out evaluation: fixed prompts and seeds, deterministic ODE sampling, every configured evaluation reward.

Recipe section ``eval`` (all optional except ``prompts``)::

    eval:
      prompts: {class_path: prompt-list, init_args: {prompts: [...]}}   # a PromptSource
      rewards: [{class_path: jpeg-compressibility}, {class_path: clipscore}]  # default: the training rewards
      num_steps: 20      # Euler ODE steps (NFE per image, before CFG doubling)
      every: 50          # also evaluated at step 0 (the "before" reference) and at the end; 0 = only those two
      seed: 1234         # prompt i uses torch.Generator().manual_seed(seed + i): independent of batch size
      batch_size: 8
      save_images: true  # per-image PNGs of every evaluation (``eval/step_N/0000.png``) besides the grid

Results go to ``eval.jsonl`` (one line per evaluation: means and per-prompt scores), ``eval.md`` (a markdown table,
regenerated each time) and ``eval/step_N.png`` (captioned grid). The sampler here is deliberately tiny and shared
with ``rlpost sample``: initial noise from the policy, then ``EulerODE`` steps along ``policy.sigmas``, then decode,
which is exactly what ``StableDiffusion3Pipeline.__call__`` does for the SD3 adapter.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlpost.api import Policy, PromptSource, RewardSource
from rlpost.images import save_grid, save_images
from rlpost.ops.kernels import EulerODE
from rlpost.rundir import json_safe

__all__ = ["EvalSettings", "EvalSpec", "Evaluator", "ode_sample"]


@dataclass
class EvalSettings:
    """Scalar settings of the ``eval`` recipe section (type-checked by jsonargparse)."""

    num_steps: int = 20
    every: int = 0
    seed: int = 1234
    batch_size: int = 8
    save_images: bool = True


@dataclass
class EvalSpec:
    """The validated ``eval`` section: components plus settings.

    Attributes:
        prompts: Held-out prompt source.
        rewards: Evaluation rewards (may include ones not trained on); shared instances with training rewards
            whose resolved configuration is identical, so their weights load once.
        settings: NFE, interval, seed, batch size.
    """

    prompts: PromptSource
    rewards: list[RewardSource]
    settings: EvalSettings = field(default_factory=EvalSettings)


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
        self.prompts: list[str] = []

    def setup(self, device: torch.device, already_set_up: Sequence[RewardSource] = ()) -> None:
        """Load the held-out prompts and set up evaluation rewards not shared with training."""
        self.prompts = [p for p, _ in self.spec.prompts.load()]
        if not self.prompts:
            raise ValueError("eval.prompts: the held-out prompt source returned no prompts")
        for reward in self.spec.rewards:
            if not any(reward is r for r in already_set_up):
                reward.setup(device)

    def due(self, step: int, max_steps: int) -> bool:
        """Whether to evaluate after ``step`` completed steps (step 0, every ``every``, and the last step)."""
        every = self.spec.settings.every
        return step == 0 or step == max_steps or (every > 0 and step % every == 0)

    def evaluate(self, step: int, is_main: bool = True) -> dict[str, float]:
        """Sample the held-out prompts, score them with every evaluation reward, write the results.

        Returns:
            ``eval/<reward>`` means (and ``perf/eval_sec``).
        """
        import time

        t0 = time.perf_counter()
        s = self.spec.settings
        seeds = [s.seed + i for i in range(len(self.prompts))]
        self.policy.train(False)  # update rules switch train mode on for their own passes
        images = ode_sample(self.policy, self.prompts, seeds, s.num_steps, s.batch_size)
        meta: list[dict[str, Any]] = [{} for _ in self.prompts]
        scores: dict[str, list[float]] = {}
        for reward in self.spec.rewards:
            values = reward.score(images.to(self.policy.device), list(self.prompts), meta).float().cpu()
            scores[reward.name] = [float(v) for v in values]
        metrics = {f"eval/{name}": sum(v) / len(v) for name, v in scores.items()}
        metrics["perf/eval_sec"] = time.perf_counter() - t0
        if is_main:
            self._write(step, images, scores, metrics)
        return metrics

    def _write(self, step: int, images: Tensor, scores: dict[str, list[float]], metrics: dict[str, float]) -> None:
        record = {
            "step": step,
            "num_steps": self.spec.settings.num_steps,
            **{k: v for k, v in metrics.items() if k.startswith("eval/")},
            "per_prompt": [
                {"prompt": p, "seed": self.spec.settings.seed + i, **{n: v[i] for n, v in scores.items()}}
                for i, p in enumerate(self.prompts)
            ],
        }
        with (self.output_dir / self.JSONL).open("a") as fh:
            fh.write(json.dumps(json_safe(record)) + "\n")
        captions = [
            f"{p} | " + " ".join(f"{n}={v[i]:.3g}" for n, v in scores.items()) for i, p in enumerate(self.prompts)
        ]
        save_grid(images, captions, self.output_dir / "eval" / f"step_{step:06d}.png")
        if self.spec.settings.save_images:
            save_images(images, self.output_dir / "eval" / f"step_{step:06d}")
        write_table(self.output_dir)


def read_evals(output_dir: Path) -> list[dict[str, Any]]:
    """Records of ``eval.jsonl`` (empty when absent)."""
    path = output_dir / Evaluator.JSONL
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def markdown_table(records: list[dict[str, Any]]) -> str:
    """Markdown table: one row per evaluation, one column per ``eval/*`` metric."""
    if not records:
        return "_no held-out evaluation recorded_\n"
    keys = sorted({k for r in records for k in r if k.startswith("eval/")})
    lines = ["| step | " + " | ".join(k.removeprefix("eval/") for k in keys) + " |"]
    lines.append("|---:|" + "---:|" * len(keys))
    for r in records:
        cells = [f"{r[k]:.4f}" if isinstance(r.get(k), (int, float)) else "" for k in keys]
        lines.append(f"| {r['step']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_table(output_dir: Path) -> None:
    """Regenerate ``eval.md`` from ``eval.jsonl``."""
    (output_dir / Evaluator.TABLE).write_text("# Held-out evaluation\n\n" + markdown_table(read_evals(output_dir)))
