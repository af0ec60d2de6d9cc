"""The digits world's training-reward classifier: a small MLP trained on sklearn digits, stored as safetensors.

The classifier reads sklearn's representation (8x8, values 0-16, bright strokes on dark); images of any size are
brought there by :func:`rlpost_digits.data.images_to_classifier_input`. It is trained on the ``train`` split (plus
each training image passed through the world's 16x16 round trip, so generated images look familiar) and evaluated on
the ``heldout`` split, which neither it nor the generator saw.

Command line::

    python -m rlpost_digits.classifier --out assets/digits-classifier
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlpost import shipped_asset
from rlpost_digits.data import digits_to_uint8_rgb, images_to_classifier_input, load_split

__all__ = [
    "DEFAULT_CLASSIFIER_DIR",
    "DigitClassifier",
    "heldout_accuracy",
    "load_classifier",
    "main",
    "train_classifier",
]

DEFAULT_CLASSIFIER_DIR = shipped_asset("digits-classifier")
"""The shipped classifier (``assets/digits-classifier`` shipped with the package: ``rlpost.shipped_asset``)."""
_WEIGHTS = "model.safetensors"
_CONFIG = "config.json"


class DigitClassifier(nn.Module):
    """``[S, 64]`` sklearn-scale digits (0-16) -> ``[S, 10]`` logits. An MLP with one hidden layer.

    Args:
        hidden: Hidden units.
    """

    def __init__(self, hidden: int = 128) -> None:
        super().__init__()
        self.hidden = hidden
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, x: Tensor) -> Tensor:
        """Logits of ``x`` (``[S, 64]``, values 0-16, as sklearn's ``load_digits().data``)."""
        logits: Tensor = self.net(x / 16.0)
        return logits

    @torch.no_grad()
    def predict_proba_images(self, images: Tensor) -> Tensor:
        """``[S, 10]`` class probabilities of ``[S, H, W, 3]`` uint8 images (bright digit on dark)."""
        feats = images_to_classifier_input(images).to(next(self.parameters()).device)
        probs: Tensor = self(feats).softmax(dim=-1)
        return probs


def train_classifier(seed: int = 0, hidden: int = 128, epochs: int = 400) -> DigitClassifier:
    """Train on the ``train`` split (originals + 16x16 round trips), full batch AdamW; deterministic for a seed."""
    images, labels = load_split("train")
    flat = images.reshape(-1, 64)
    roundtrip = images_to_classifier_input(digits_to_uint8_rgb(images))
    x, y = torch.cat([flat, roundtrip]), torch.cat([labels, labels])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DigitClassifier(hidden)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-2)
        gen = torch.Generator().manual_seed(seed)
        for _ in range(epochs):
            # Light pixel noise keeps the decision surface smooth for slightly off-manifold generated digits.
            xb = (x + torch.randn(x.shape, generator=gen) * 0.5).clamp(0, 16)
            loss = F.cross_entropy(model(xb), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
    return model.eval().requires_grad_(False)


@torch.no_grad()
def heldout_accuracy(model: DigitClassifier) -> float:
    """Accuracy on the held-out split's original 8x8 images."""
    images, labels = load_split("heldout")
    return float((model(images.reshape(-1, 64)).argmax(-1) == labels).float().mean())


def save_classifier(model: DigitClassifier, out: Path, extra: dict[str, Any] | None = None) -> Path:
    """Write ``model.safetensors`` and ``config.json`` into ``out``."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / _WEIGHTS))
    config = {"architecture": "mlp-64-hidden-10", "hidden": model.hidden, "input": "sklearn 8x8, 0-16"} | (extra or {})
    (out / _CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out


def load_classifier(path: str | Path | None = None, device: torch.device | str = "cpu") -> DigitClassifier:
    """Load a saved classifier (default: the shipped asset) in eval mode, frozen.

    Raises:
        FileNotFoundError: When the directory lacks ``config.json`` or ``model.safetensors``.
    """
    from safetensors.torch import load_file

    directory = Path(path) if path is not None else DEFAULT_CLASSIFIER_DIR
    if not (directory / _CONFIG).is_file() or not (directory / _WEIGHTS).is_file():
        raise FileNotFoundError(f"digits classifier: {directory} needs {_CONFIG} and {_WEIGHTS}")
    config = json.loads((directory / _CONFIG).read_text(encoding="utf-8"))
    model = DigitClassifier(int(config["hidden"]))
    model.load_state_dict(load_file(str(directory / _WEIGHTS)))
    return model.to(device).eval().requires_grad_(False)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry: train, report held-out accuracy, save."""
    parser = argparse.ArgumentParser(description="Train the digits-world classifier (reward judge).")
    parser.add_argument("--out", type=Path, default=DEFAULT_CLASSIFIER_DIR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=400)
    args = parser.parse_args(argv)
    model = train_classifier(args.seed, args.hidden, args.epochs)
    acc = heldout_accuracy(model)
    save_classifier(model, args.out, {"seed": args.seed, "epochs": args.epochs, "heldout_accuracy": round(acc, 4)})
    print(f"held-out accuracy {acc:.4f} -> {args.out}")


if __name__ == "__main__":
    main()
