"""The digits world's second judge: a small CNN on 16x16 pixels, independent of the training reward's classifier.

Evaluation scores samples with ``digit-judge`` next to ``digit-alignment`` so that reward hacking shows: a policy
that learns to please the training classifier (:mod:`rlpost_digits.classifier`, an MLP on 8x8 area-pooled pixels)
without drawing better digits raises ``digit-alignment`` but not ``digit-judge``. The judge is independent by
construction:

* **another model family**: convolutions with max pooling (translation-equivariant features), not a dense MLP;
* **other preprocessing**: it reads the image at 16x16 (bilinear, antialiased resize if generated at another size),
  gray in ``[0, 1]``, instead of sklearn's 8x8 grid on the 0-16 scale;
* **other training data distribution**: every epoch each training digit is randomly shifted (up to 2 pixels at 16x16,
  i.e. one sklearn pixel), blurred (Gaussian, sigma up to 1.2 pixels), rescaled in brightness and noised, so it
  judges the shape of the digit rather than exact pixel positions;
* its own seed; it is never used as a training reward by any shipped recipe (the recipe schema forbids a judge that
  is also a training reward).

Like the classifier it trains on the ``train`` image split only and is measured on the ``heldout`` split (360 images
neither it nor the generator saw), through the world's 16x16 uint8 round trip, as generated images are read.

Command line (deterministic for a seed, thread count and machine)::

    python -m rlpost_digits.judge --out assets/digits-judge
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlpost import shipped_asset
from rlpost_digits.data import RESOLUTION, digits_to_uint8_rgb, load_split

__all__ = [
    "DEFAULT_JUDGE_DIR",
    "DigitJudge",
    "augment",
    "images_to_judge_input",
    "judge_accuracy",
    "load_judge",
    "main",
    "save_judge",
    "train_judge",
]

DEFAULT_JUDGE_DIR = shipped_asset("digits-judge")
"""The shipped judge (``assets/digits-judge`` shipped with the package: ``rlpost.shipped_asset``)."""
_WEIGHTS = "model.safetensors"
_CONFIG = "config.json"
MAX_SHIFT = 2
"""Largest random shift in pixels (at 16x16) during training."""
MAX_BLUR_SIGMA = 1.2
"""Largest Gaussian blur sigma in pixels (at 16x16) during training."""


def images_to_judge_input(images: Tensor, resolution: int = RESOLUTION) -> Tensor:
    """``[S, H, W, 3]`` uint8 RGB -> ``[S, 1, R, R]`` float32 gray in ``[0, 1]`` (bright digit on dark).

    Images of another size are resized bilinearly with antialiasing (not area-pooled as the classifier does).
    """
    if images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"expected [S, H, W, 3] images, got shape {tuple(images.shape)}")
    x = images.float().mean(dim=-1).unsqueeze(1) / 255.0
    if tuple(x.shape[-2:]) != (resolution, resolution):
        x = F.interpolate(x, size=(resolution, resolution), mode="bilinear", antialias=True, align_corners=False)
    return x.clamp(0.0, 1.0)


class DigitJudge(nn.Module):
    """``[S, 1, 16, 16]`` gray digits in ``[0, 1]`` -> ``[S, 10]`` logits. Two conv + max-pool stages, one linear.

    Args:
        channels: Output channels of the two 3x3 convolutions.
    """

    def __init__(self, channels: tuple[int, int] = (16, 32)) -> None:
        super().__init__()
        self.channels = tuple(int(c) for c in channels)
        c1, c2 = self.channels
        self.features = nn.Sequential(
            nn.Conv2d(1, c1, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 16 -> 8
            nn.Conv2d(c1, c2, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 8 -> 4
        )
        self.head = nn.Linear(c2 * (RESOLUTION // 4) ** 2, 10)

    def forward(self, x: Tensor) -> Tensor:
        """Logits of ``x`` (``[S, 1, 16, 16]``, values in ``[0, 1]``)."""
        # Centre the input so the first layer starts unbiased by the mostly-dark background.
        logits: Tensor = self.head(self.features(x - 0.5).flatten(1))
        return logits

    @torch.no_grad()
    def predict_proba_images(self, images: Tensor) -> Tensor:
        """``[S, 10]`` class probabilities of ``[S, H, W, 3]`` uint8 images (bright digit on dark)."""
        feats = images_to_judge_input(images).to(next(self.parameters()).device)
        probs: Tensor = self(feats).softmax(dim=-1)
        return probs


def _gaussian_blur(x: Tensor, sigma: Tensor) -> Tensor:
    """Blur each ``[1, H, W]`` image of ``x`` with its own Gaussian (``sigma`` per image; 0 leaves it unchanged)."""
    radius = math.ceil(2 * MAX_BLUR_SIGMA)
    taps = torch.arange(-radius, radius + 1, dtype=x.dtype)
    s = sigma.clamp_min(1e-3).view(-1, 1)
    k = torch.exp(-(taps.view(1, -1) ** 2) / (2 * s**2))
    k = k / k.sum(dim=1, keepdim=True)  # [N, K]; sigma -> 0 gives a delta
    n, _, h, w = x.shape
    # Separable, one kernel per image: fold the batch into channels and use grouped convolutions.
    y = F.pad(x.reshape(1, n, h, w), (radius, radius, radius, radius), mode="replicate")
    y = F.conv2d(y, k.view(n, 1, 1, -1), groups=n)
    y = F.conv2d(y, k.view(n, 1, -1, 1), groups=n)
    return y.reshape(n, 1, h, w)


def augment(x: Tensor, generator: torch.Generator) -> Tensor:
    """Random shift, blur, brightness and noise of ``[N, 1, R, R]`` judge inputs (deterministic for a generator).

    Shift: integers in ``[-MAX_SHIFT, MAX_SHIFT]`` per axis, zero (dark) fill. Blur: sigma ~ U(0, MAX_BLUR_SIGMA),
    applied to half the images. Brightness: gain ~ U(0.7, 1.2). Noise: N(0, 0.05) per pixel. Clamped to ``[0, 1]``.
    """
    n, _, h, w = x.shape
    shifts = torch.randint(-MAX_SHIFT, MAX_SHIFT + 1, (n, 2), generator=generator)
    padded = F.pad(x, (MAX_SHIFT, MAX_SHIFT, MAX_SHIFT, MAX_SHIFT))
    rows = (torch.arange(h).view(1, h) + MAX_SHIFT - shifts[:, :1]).view(n, 1, h, 1).expand(n, 1, h, w + 2 * MAX_SHIFT)
    out = padded.gather(2, rows)
    cols = (torch.arange(w).view(1, w) + MAX_SHIFT - shifts[:, 1:]).view(n, 1, 1, w).expand(n, 1, h, w)
    out = out.gather(3, cols)
    sigma = torch.rand(n, generator=generator) * MAX_BLUR_SIGMA
    sigma = torch.where(torch.rand(n, generator=generator) < 0.5, sigma, torch.zeros_like(sigma))
    out = _gaussian_blur(out, sigma)
    gain = 0.7 + 0.5 * torch.rand(n, 1, 1, 1, generator=generator)
    noise = torch.randn(out.shape, generator=generator) * 0.05
    return (out * gain + noise).clamp(0.0, 1.0)


def _split_inputs(split: str) -> tuple[Tensor, Tensor]:
    images, labels = load_split(split)  # type: ignore[arg-type]
    return images_to_judge_input(digits_to_uint8_rgb(images)), labels


def train_judge(
    seed: int = 0,
    channels: tuple[int, int] = (16, 32),
    epochs: int = 80,
    batch_size: int = 128,
    lr: float = 3e-3,
) -> DigitJudge:
    """Train on the ``train`` image split (16x16 round trips) with fresh augmentation every epoch; deterministic.

    Mini-batch AdamW with a cosine learning-rate decay; the shuffling and the augmentation draw from one generator
    seeded with ``seed``, the weights from ``torch.manual_seed(seed)`` (the global RNG state is restored afterwards).
    """
    x, y = _split_inputs("train")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DigitJudge(channels)
    gen = torch.Generator().manual_seed(seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    steps_per_epoch = math.ceil(x.shape[0] / batch_size)
    total = epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    model.train()
    for _ in range(epochs):
        order = torch.randperm(x.shape[0], generator=gen)
        for start in range(0, x.shape[0], batch_size):
            idx = order[start : start + batch_size]
            loss = F.cross_entropy(model(augment(x[idx], gen)), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            sched.step()
    return model.eval().requires_grad_(False)


@torch.no_grad()
def judge_accuracy(model: DigitJudge, augmented: bool = False, seed: int = 0) -> float:
    """Accuracy on the ``heldout`` image split as the world renders it (16x16 uint8 round trip).

    Args:
        model: The judge.
        augmented: Score shifted/blurred/noised copies (the training augmentation, seeded) instead of clean images.
        seed: Seed of the augmentation when ``augmented``.
    """
    x, y = _split_inputs("heldout")
    if augmented:
        x = augment(x, torch.Generator().manual_seed(seed))
    device = next(model.parameters()).device
    return float((model(x.to(device)).argmax(-1).cpu() == y).float().mean())


def save_judge(model: DigitJudge, out: Path, extra: dict[str, Any] | None = None) -> Path:
    """Write ``model.safetensors`` and ``config.json`` into ``out``."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / _WEIGHTS))
    config = {
        "architecture": "cnn-conv3x3-maxpool-x2-linear",
        "channels": list(model.channels),
        "input": f"gray {RESOLUTION}x{RESOLUTION} in [0, 1] (bilinear antialiased resize)",
    } | (extra or {})
    (out / _CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out


def load_judge(path: str | Path | None = None, device: torch.device | str = "cpu") -> DigitJudge:
    """Load a saved judge (default: the shipped asset) in eval mode, frozen.

    Raises:
        FileNotFoundError: When the directory lacks ``config.json`` or ``model.safetensors``.
    """
    from safetensors.torch import load_file

    directory = Path(path) if path is not None else DEFAULT_JUDGE_DIR
    if not (directory / _CONFIG).is_file() or not (directory / _WEIGHTS).is_file():
        raise FileNotFoundError(f"digits judge: {directory} needs {_CONFIG} and {_WEIGHTS}")
    config = json.loads((directory / _CONFIG).read_text(encoding="utf-8"))
    c1, c2 = (int(c) for c in config["channels"])
    model = DigitJudge((c1, c2))
    model.load_state_dict(load_file(str(directory / _WEIGHTS)))
    return model.to(device).eval().requires_grad_(False)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry: train, report held-out accuracy (clean and augmented), save."""
    parser = argparse.ArgumentParser(description="Train the digits-world second judge (a CNN; evaluation only).")
    parser.add_argument("--out", type=Path, default=DEFAULT_JUDGE_DIR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=80)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = train_judge(args.seed, epochs=args.epochs)
    acc, acc_aug = judge_accuracy(model), judge_accuracy(model, augmented=True)
    extra = {
        "seed": args.seed,
        "epochs": args.epochs,
        "augmentation": {"max_shift_px": MAX_SHIFT, "max_blur_sigma_px": MAX_BLUR_SIGMA, "gain": [0.7, 1.2]},
        "heldout_accuracy": round(acc, 4),
        "heldout_accuracy_augmented": round(acc_aug, 4),
    }
    save_judge(model, args.out, extra)
    print(f"held-out accuracy {acc:.4f} (augmented {acc_aug:.4f}) -> {args.out}")


if __name__ == "__main__":
    main()
