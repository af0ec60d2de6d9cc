"""Fixtures for the reward-source tests: tiny models of the real architectures with random weights, saved in the
real checkpoint formats, and deterministic uint8 images."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

TINY_CLIP = "rlpost-test-tiny-clip"
TINY_CLIP_CFG = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


@pytest.fixture(scope="session")
def tiny_clip_name(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Register a tiny open_clip config (same CLIP architecture as ViT-H-14, tiny sizes) and return its name."""
    import open_clip

    cfg_dir = tmp_path_factory.mktemp("open_clip_cfg")
    (cfg_dir / f"{TINY_CLIP}.json").write_text(json.dumps(TINY_CLIP_CFG))
    open_clip.add_model_config(cfg_dir)
    return TINY_CLIP


@pytest.fixture(scope="session")
def tiny_clip_state(tiny_clip_name: str) -> dict[str, torch.Tensor]:
    """Random weights of the tiny open_clip model (seeded)."""
    import open_clip

    torch.manual_seed(0)
    model = open_clip.create_model(tiny_clip_name, pretrained=None)
    return {k: v.clone() for k, v in model.state_dict().items()}


def make_images(n: int = 8, size: int = 40, seed: int = 0) -> torch.Tensor:
    """``[n, size, size, 3]`` uint8 images with some structure (gradients + noise), deterministic."""
    g = torch.Generator().manual_seed(seed)
    ramp = torch.linspace(0, 255, size)
    base = (ramp[None, :, None] + ramp[:, None, None]) / 2
    noise = torch.randint(0, 80, (n, size, size, 3), generator=g).float()
    shift = torch.arange(n).float().view(n, 1, 1, 1) * 17
    return ((base[None] + noise + shift) % 256).to(torch.uint8)


PROMPTS = [
    "a photo of a cat",
    "a red car on a street",
    "an astronaut riding a horse",
    "a bowl of fruit",
    "a watercolor painting of mountains",
    "a dog wearing sunglasses",
    "a city at night",
    "a plate of sushi",
]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP byte -> printable unicode table (restated from the CLIP tokenizer's definition)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, [chr(c) for c in chars], strict=True))


def write_clip_tokenizer(out_dir: Path, num_merges: int = 600) -> int:
    """Write a small CLIP BPE tokenizer (``vocab.json`` + ``merges.txt``) from open_clip's bundled merges and save it
    as a transformers ``CLIPTokenizer`` directory. Returns the vocabulary size."""
    import gzip
    import importlib.resources

    from transformers import CLIPTokenizer

    path = importlib.resources.files("open_clip") / "bpe_simple_vocab_16e6.txt.gz"
    lines = gzip.decompress(path.read_bytes()).decode("utf-8").split("\n")[1 : num_merges + 1]
    merges = [tuple(line.split()) for line in lines]
    vocab = list(_bytes_to_unicode().values())
    vocab = vocab + [v + "</w>" for v in vocab] + ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    raw = out_dir / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    (raw / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(vocab)}))
    (raw / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")
    tokenizer = CLIPTokenizer(str(raw / "vocab.json"), str(raw / "merges.txt"))
    tokenizer.save_pretrained(str(out_dir))
    assert len(tokenizer) == len(vocab)
    return len(vocab)


def tiny_hf_clip(vocab_size: int, projection_dim: int = 16, image_size: int = 32, seed: int = 0):  # noqa: ANN201
    """A tiny transformers ``CLIPModel`` (random weights, seeded) whose text tower matches ``vocab_size``."""
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(seed)
    config = CLIPConfig(
        text_config={
            "vocab_size": vocab_size,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "max_position_embeddings": 77,
            "bos_token_id": vocab_size - 2,
            "eos_token_id": vocab_size - 1,
            "pad_token_id": vocab_size - 1,
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": image_size,
            "patch_size": 8,
        },
        projection_dim=projection_dim,
    )
    return CLIPModel(config).eval()


class LoadCounter:
    """Wraps a function and counts calls (to check a reward loads its model once)."""

    def __init__(self, fn):  # noqa: ANN001
        self.fn = fn
        self.calls = 0

    def __call__(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN204
        self.calls += 1
        return self.fn(*args, **kwargs)


def check_reward_contract(reward, images: torch.Tensor, prompts: list[str], tol: float = 1e-5) -> torch.Tensor:  # noqa: ANN001
    """Shared checks: finite fp32 ``[S]``; deterministic; batch of S agrees with S single-image calls."""
    meta = [{} for _ in prompts]
    scores = reward.score(images, prompts, meta)
    assert scores.shape == (images.shape[0],) and scores.dtype == torch.float32
    assert torch.isfinite(scores).all()
    again = reward.score(images, prompts, meta)
    assert torch.equal(scores, again), "scores must be deterministic"
    singles = torch.cat(
        [reward.score(images[i : i + 1], prompts[i : i + 1], meta[i : i + 1]) for i in range(len(prompts))]
    )
    torch.testing.assert_close(singles, scores, atol=tol, rtol=0)
    assert scores.std() > 0, "random tiny model should still discriminate between images"
    return scores
