"""Tiny random-weight checkpoints of the first-party reward models, in their released formats, loaded by the tests
through the production loaders (``rlpost_rewards``): an open_clip model (HPS-v2.1, CLIPScore), transformers CLIP
directories (PickScore, the LAION aesthetic predictor's backbone) and an ImageReward checkpoint with upstream's key
names. Shared by the reward tests and the conformance kit's run over every first-party component
(``tests/meta/test_conformance.py``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "MED",
    "OPENAI_MEAN",
    "OPENAI_STD",
    "TINY_CLIP",
    "TINY_CLIP_CFG",
    "VIT",
    "WORDS",
    "random_upstream_state",
    "register_tiny_open_clip",
    "save_processor",
    "tiny_hf_clip",
    "tiny_open_clip_state",
    "upstream_shapes",
    "write_aesthetic_files",
    "write_clip_tokenizer",
    "write_imagereward_files",
    "write_pickscore_dirs",
]

OPENAI_MEAN, OPENAI_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]

TINY_CLIP = "rlpost-test-tiny-clip"
TINY_CLIP_CFG = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


def register_tiny_open_clip(cfg_dir: Path) -> str:
    """Register a tiny open_clip config (same CLIP architecture as ViT-H-14, tiny sizes) and return its name."""
    import open_clip

    cfg_dir.mkdir(parents=True, exist_ok=True)
    (cfg_dir / f"{TINY_CLIP}.json").write_text(json.dumps(TINY_CLIP_CFG))
    open_clip.add_model_config(cfg_dir)
    return TINY_CLIP


def tiny_open_clip_state(name: str) -> dict[str, torch.Tensor]:
    """Random weights of the tiny open_clip model (seeded)."""
    import open_clip

    torch.manual_seed(0)
    model = open_clip.create_model(name, pretrained=None)
    return {k: v.clone() for k, v in model.state_dict().items()}


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


def save_processor(directory: Path, size: int, mean: list[float], std: list[float]) -> None:
    """A ``preprocessor_config.json`` as the hub snapshots carry (shortest edge = crop, bicubic)."""
    from transformers import CLIPImageProcessorPil

    processor = CLIPImageProcessorPil(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}, image_mean=mean, image_std=std
    )
    processor.save_pretrained(str(directory))


def write_pickscore_dirs(root: Path) -> tuple[Path, Path, int]:
    """PickScore layout: a CLIPModel directory, and a tokenizer directory with a (non-OpenAI) processor config;
    returns (model dir, tokenizer dir, vocabulary size)."""
    tok_dir = root / "tokenizer"
    vocab = write_clip_tokenizer(tok_dir)
    save_processor(tok_dir, 32, [0.5] * 3, [0.25] * 3)
    model_dir = root / "model"
    tiny_hf_clip(vocab).save_pretrained(str(model_dir))  # safetensors, as the hub snapshots
    return model_dir, tok_dir, vocab


def write_aesthetic_files(root: Path) -> tuple[Path, Path]:
    """``openai/clip-vit-large-patch14`` layout (model + OpenAI processor config) and a random predictor head;
    returns (CLIP dir, head file)."""
    import rlpost_rewards.aesthetic as aesthetic_mod

    clip_dir = root / "clip-vit-large-patch14"
    tiny_hf_clip(600, seed=3).save_pretrained(str(clip_dir))
    save_processor(clip_dir, 32, OPENAI_MEAN, OPENAI_STD)
    torch.manual_seed(1)
    head = aesthetic_mod.AestheticMLP(16)
    with torch.no_grad():  # random weights scaled so every layer matters (released head: trained weights)
        for layer in head.layers:
            if isinstance(layer, torch.nn.Linear):
                layer.weight.normal_(0, layer.in_features**-0.5)
                layer.bias.normal_(0, 0.1)
    head_path = root / "sac+logos+ava1-l14-linearMSE.pth"
    torch.save(head.state_dict(), head_path)
    return clip_dir, head_path


WORDS = "a photo of cat red car on street an astronaut riding horse bowl fruit watercolor painting mountains dog"
WORDS += " wearing sunglasses city at night plate sushi the"
MED = {
    "hidden_size": 32,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "intermediate_size": 64,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-12,
    "max_position_embeddings": 40,
    "pad_token_id": 0,
    "type_vocab_size": 2,
    "add_cross_attention": True,
    "encoder_width": 768,
}
# BLIP's create_vit ties heads to width (12 at 768, 16 at 1024: width / 64); here 128 / 64 = 2.
VIT = {"image_size": 32, "patch_size": 8, "width": 128, "depth": 2, "mlp_ratio": 4}


def upstream_shapes(vit: dict, med: dict, embed_dim: int = 256, mlp_in: int | None = None) -> dict[str, list[int]]:
    """Names and shapes of ``ImageReward(med_config).state_dict()``: ``blip`` = ``BLIP_Pretrain`` (ViT from
    ``vit.py``, ``BertModel(add_pooling_layer=False)`` from ``med.py``, ``vision_proj``/``text_proj`` to
    ``embed_dim``), then ``mlp`` = ``MLP(768)`` (``mlp_in`` overrides 768 for tiny text towers)."""
    d, p, n = vit["width"], vit["patch_size"], (vit["image_size"] // vit["patch_size"]) ** 2
    h, hid, inter = med["hidden_size"], vit["width"] * vit["mlp_ratio"], med["intermediate_size"]
    out: dict[str, list[int]] = {}

    def linear(name: str, o: int, i: int) -> None:
        out[f"{name}.weight"], out[f"{name}.bias"] = [o, i], [o]

    def norm(name: str, width: int) -> None:
        out[f"{name}.weight"], out[f"{name}.bias"] = [width], [width]

    v = "blip.visual_encoder"
    out[f"{v}.cls_token"], out[f"{v}.pos_embed"] = [1, 1, d], [1, n + 1, d]
    out[f"{v}.patch_embed.proj.weight"], out[f"{v}.patch_embed.proj.bias"] = [d, 3, p, p], [d]
    for i in range(vit["depth"]):
        b = f"{v}.blocks.{i}"
        norm(f"{b}.norm1", d)
        linear(f"{b}.attn.qkv", 3 * d, d)
        linear(f"{b}.attn.proj", d, d)
        norm(f"{b}.norm2", d)
        linear(f"{b}.mlp.fc1", hid, d)
        linear(f"{b}.mlp.fc2", d, hid)
    norm(f"{v}.norm", d)
    t = "blip.text_encoder"
    out[f"{t}.embeddings.position_ids"] = [1, med["max_position_embeddings"]]  # persistent buffer in med.py
    out[f"{t}.embeddings.word_embeddings.weight"] = [med["vocab_size"], h]
    out[f"{t}.embeddings.position_embeddings.weight"] = [med["max_position_embeddings"], h]
    norm(f"{t}.embeddings.LayerNorm", h)
    for i in range(med["num_hidden_layers"]):
        layer = f"{t}.encoder.layer.{i}"
        for block, kv_width in (("attention", h), ("crossattention", d)):  # cross-attention keys read the ViT
            linear(f"{layer}.{block}.self.query", h, h)
            linear(f"{layer}.{block}.self.key", h, kv_width)
            linear(f"{layer}.{block}.self.value", h, kv_width)
            linear(f"{layer}.{block}.output.dense", h, h)
            norm(f"{layer}.{block}.output.LayerNorm", h)
        linear(f"{layer}.intermediate.dense", inter, h)
        linear(f"{layer}.output.dense", h, inter)
        norm(f"{layer}.output.LayerNorm", h)
    linear("blip.vision_proj", embed_dim, d)
    linear("blip.text_proj", embed_dim, h)
    head = ((1024, mlp_in or 768), (128, 1024), (64, 128), (16, 64), (1, 16))
    for j, (o, i) in zip((0, 2, 4, 6, 7), head, strict=True):
        linear(f"mlp.layers.{j}", o, i)
    return out


def random_upstream_state(shapes: dict[str, list[int]], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors for ``shapes``, scaled so every layer matters: linear/conv weights ~ 1/sqrt(fan_in), norm
    weights ~ 1 ± 0.1, biases and embeddings O(0.1-1)."""
    g = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        if name.endswith("position_ids"):
            state[name] = torch.arange(shape[1])[None]
        elif "norm" in name.lower() and name.endswith("weight"):
            state[name] = 1 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith("embeddings.weight") or name.endswith(("cls_token", "pos_embed")):
            state[name] = torch.randn(shape, generator=g)
        elif len(shape) >= 2:
            state[name] = torch.randn(shape, generator=g) / math.sqrt(math.prod(shape[1:]))
        else:
            state[name] = 0.1 * torch.randn(shape, generator=g)
    return state


def write_imagereward_files(root: Path) -> dict[str, Any]:
    """Tiny ``ImageReward.pt`` (upstream names, random weights), ``med_config.json`` and a BERT tokenizer dir under
    ``root`` (the default names under ``$RLPOST_MODELS``); returns their paths, the state and the config."""
    from transformers import BertTokenizer

    raw = root / "raw_vocab.txt"
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab += sorted(set(WORDS.split()) | set("bcdefghijklmnopqrstuvwxyz"))
    raw.write_text("\n".join(vocab) + "\n")
    tok_dir = root / "bert-base-uncased"
    BertTokenizer(str(raw)).save_pretrained(str(tok_dir))
    med = dict(MED, vocab_size=len(vocab) + 2)  # + BLIP's [DEC] and [ENC]
    (root / "ImageReward").mkdir()
    (root / "ImageReward" / "med_config.json").write_text(json.dumps(med))
    state = random_upstream_state(upstream_shapes(VIT, med, embed_dim=8, mlp_in=MED["hidden_size"]))
    torch.save(state, root / "ImageReward" / "ImageReward.pt")  # upstream saves model.state_dict() as is
    return {"root": root, "tok": tok_dir, "ckpt": root / "ImageReward" / "ImageReward.pt", "state": state, "med": med}
