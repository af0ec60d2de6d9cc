"""Sample accuracy of a digits pipeline: generate through ``SD3Policy`` with Euler ODE steps, classify, compare.

Scores with both the training reward's classifier (``digit-alignment``) and the independent judge
(``digit-judge``). Command line::

    python -m rlpost_digits.evaluate --model assets/digits-sd3 --num 200 --nfe 10 --guidance 4.0 --seed 0 --split eval
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlpost_digits.data import PROMPT_SPLITS, RESOLUTION, PromptSplit
from rlpost_digits.prompts import DigitsPrompts

__all__ = ["generate", "main", "sample_accuracy"]

DEFAULT_GUIDANCE = 4.0
"""CFG scale the digits recipes use."""


def _policy(model: str | Path, guidance: float) -> Any:
    from rlpost import SD3Policy
    from rlpost_digits.pretrain import MAX_SEQUENCE_LENGTH

    policy = SD3Policy(
        pretrained=str(model),
        resolution=RESOLUTION,
        guidance_scale=guidance,
        max_sequence_length=MAX_SEQUENCE_LENGTH,
    )
    policy.setup(torch.device("cpu"))
    return policy


@torch.no_grad()
def generate(policy: Any, prompts: list[str], nfe: int, seed: int) -> Tensor:
    """``[N, H, W, 3]`` uint8 images for ``prompts`` by Euler ODE sampling through the policy's schedule."""
    from rlpost import EulerODE

    kernel = EulerODE()
    x = policy.initial_noise(len(prompts), torch.Generator().manual_seed(seed))
    cond = policy.encode(prompts)
    sig = policy.sigmas(nfe)
    b = x.shape[0]
    for i in range(nfe):
        s, sn = sig[i].expand(b), sig[i + 1].expand(b)
        x = kernel.step(x, policy.velocity(x, s, cond), s, sn, None).next_latents
    images: Tensor = policy.decode(x).flatten(0, 1)  # [N, 1, H, W, 3] one-frame media -> [N, H, W, 3] images
    return images


def sample_accuracy(
    model: str | Path,
    num: int = 200,
    nfe: int = 10,
    guidance: float = DEFAULT_GUIDANCE,
    seed: int = 0,
    split: PromptSplit = "pretrain",
    classifier: str | None = None,
    judge: str | None = None,
) -> dict[str, Any]:
    """Generate ``num`` samples cycling through the split's prompts, and classify them.

    Returns:
        ``accuracy`` (fraction classified as the prompted digit), ``mean_reward`` (mean ``digit-alignment``),
        ``per_digit`` accuracies, the same two for the independent judge (``judge_accuracy``, ``judge_mean``) and
        the settings.
    """
    from rlpost_digits.reward import DigitAlignmentReward, DigitJudgeReward

    items = DigitsPrompts(split=split).load()
    chosen = [items[i % len(items)] for i in range(num)]
    prompts = [p for p, _ in chosen]
    meta = [m for _, m in chosen]
    policy = _policy(model, guidance)
    images = torch.cat([generate(policy, prompts[i : i + 100], nfe, seed + i) for i in range(0, num, 100)])
    reward = DigitAlignmentReward(classifier)
    reward.setup(torch.device("cpu"))
    probs = reward._model.predict_proba_images(images)
    target = torch.tensor([m["digit"] for m in meta])
    correct = probs.argmax(-1) == target
    per_digit = {d: round(float(correct[target == d].float().mean()), 3) for d in range(10) if (target == d).any()}
    second = DigitJudgeReward(judge)
    second.setup(torch.device("cpu"))
    judge_correct = second._model.predict_proba_images(images).argmax(-1) == target
    return {
        "accuracy": round(float(correct.float().mean()), 4),
        "mean_reward": round(float(reward.score(images, prompts, meta).mean()), 4),
        "judge_accuracy": round(float(judge_correct.float().mean()), 4),
        "judge_mean": round(float(second.score(images, prompts, meta).mean()), 4),
        "per_digit": per_digit,
        "num": num,
        "nfe": nfe,
        "guidance": guidance,
        "seed": seed,
        "split": split,
    }


def main(argv: list[str] | None = None) -> None:
    """Command-line entry: print the sample accuracy as JSON (and optionally save a PNG grid)."""
    parser = argparse.ArgumentParser(description="Sample accuracy of a digits pipeline (classifier judged).")
    parser.add_argument("--model", type=Path, default=Path("assets/digits-sd3"))
    parser.add_argument("--num", type=int, default=200)
    parser.add_argument("--nfe", type=int, default=10)
    parser.add_argument("--guidance", type=float, default=DEFAULT_GUIDANCE)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", choices=sorted(PROMPT_SPLITS), default="pretrain")
    parser.add_argument("--grid", type=Path, default=None, help="write a PNG grid of 10 samples per digit")
    args = parser.parse_args(argv)
    print(json.dumps(sample_accuracy(args.model, args.num, args.nfe, args.guidance, args.seed, args.split)))
    if args.grid is not None:
        from PIL import Image

        policy = _policy(args.model, args.guidance)
        items = DigitsPrompts(split=args.split).load()
        prompts = [p for p, _ in items[:10]] * 10  # one template, digits 0..9, ten times
        imgs = generate(policy, prompts, args.nfe, args.seed)  # [100, H, W, 3]: row r = sample r of digits 0..9
        r = imgs.shape[1]
        grid = imgs.reshape(10, 10, r, r, 3).permute(0, 2, 1, 3, 4).reshape(10 * r, 10 * r, 3)
        Image.fromarray(grid.numpy()).resize((40 * r, 40 * r), Image.Resampling.NEAREST).save(args.grid)


if __name__ == "__main__":
    main()
