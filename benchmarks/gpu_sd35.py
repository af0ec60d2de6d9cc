"""TreeGRPO vs DanceGRPO vs MixGRPO vs DDPO speed on the SD3.5-medium architecture at 512 px on one GPU.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/gpu_sd35.py --out runs/bench-sd35-gpu [--groups 4]

The same comparison as ``rlpost bench --recipe recipes/bench/digits.yaml`` (one process, one Runner per algorithm,
interleaved by least accumulated time, counted vs predicted transformer rows, calibrated time model, phase
breakdown), on the model the TreeGRPO paper used. Without CUDA it prints why and exits 0.

Model: ``stabilityai/stable-diffusion-3.5-medium`` when it is in the local Hugging Face cache (nothing is
downloaded), else a **random-weight pipeline of the SD3.5-medium architecture** built once into ``--build-dir``:
the transformer exactly as SD3.5-M's ``transformer/config.json`` (24 MMDiT-X blocks, 24 heads x 64, dual attention in
blocks 0-12, RMS qk-norm, patch 2, 16 latent channels, 2.5B parameters) and the VAE as SD3.5's (16 channels, factor 8).
Speed does not depend on weight values. The three text encoders keep SD3.5's output widths (CLIP-L 768, CLIP-G 1280,
T5 4096, so the transformer sees the same 77 + 256 = 333 context tokens) but only one layer each: prompt embeddings
are computed once per prompt and cached by the policy, so encoder depth never enters an iteration's time.

Shared settings (arXiv 2512.08153, Sec. "Experiments", where it speaks; otherwise our choices, reported in
docs/benchmarks.md): NFE 10, CFG 4.5, LoRA rank 64 on the transformer
(four 2.5B models with full AdamW state do not fit one GPU side by side; forward/backward cost is the same as full
fine-tuning up to the adapter), gradient checkpointing, AdamW lr 1e-5 wd 0.01, clip 1e-4, one optimizer step per
rollout. TreeGRPO k=3, d=3, r=0.5; DanceGRPO group 12, eta 0.3, timestep fraction 0.6; MixGRPO window 2 (4 of 25
rescaled to 10), tau 25, group 12; DDPO all 9 stochastic steps, per-prompt tracker 16/16, 12 images per prompt.
Reward: ``jpeg-compressibility`` by default (HPS-v2.1 needs weights that cannot be fetched here; pass
``--reward hps-v2.1`` when its checkpoint is installed). The paper's batch is 32 prompts (``--groups 32``); the
default 4 keeps one iteration to seconds-to-minutes.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

SD35_MEDIUM_TRANSFORMER: dict[str, Any] = {
    # stabilityai/stable-diffusion-3.5-medium, transformer/config.json
    "sample_size": 128,
    "patch_size": 2,
    "in_channels": 16,
    "num_layers": 24,
    "attention_head_dim": 64,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "caption_projection_dim": 1536,
    "pooled_projection_dim": 2048,
    "out_channels": 16,
    "pos_embed_max_size": 384,
    "dual_attention_layers": list(range(13)),
    "qk_norm": "rms_norm",
}
SD35_VAE: dict[str, Any] = {
    # stabilityai/stable-diffusion-3.5-medium, vae/config.json
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "latent_channels": 16,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "scaling_factor": 1.5305,
    "shift_factor": 0.0609,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}
REAL_MODEL = "stabilityai/stable-diffusion-3.5-medium"
PROMPTS = [
    "a photo of a red fox in the snow",
    "a watercolor painting of a lighthouse",
    "a bowl of ramen, studio lighting",
    "an astronaut riding a horse on the moon",
    "a cozy cabin in a pine forest at dusk",
    "a portrait of an old sailor",
    "a futuristic city skyline at night",
    "a macro photo of a dragonfly",
    "a vintage car on a desert road",
    "a cat wearing a tiny wizard hat",
    "a plate of sushi on a wooden table",
    "a castle on a cliff above the sea",
    "a field of sunflowers under a blue sky",
    "a robot reading a book in a library",
    "a steaming cup of coffee",
    "a hot air balloon over mountains",
]


def real_model_available() -> str | None:
    """The local snapshot directory of SD3.5-medium when it is in the HF cache (never downloads)."""
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(REAL_MODEL, local_files_only=True))
    except Exception:  # noqa: BLE001 - any failure means "not available locally"
        return None


def build_random_sd35(out_dir: Path, num_layers: int | None = None, device: str = "cuda") -> Path:
    """Save a random-weight ``StableDiffusion3Pipeline`` of the SD3.5-medium architecture (bf16 transformer).

    Args:
        out_dir: Target directory (reused when ``model_index.json`` exists).
        num_layers: Override the transformer depth (CPU smoke tests only; ``None`` = SD3.5-M's 24).
        device: Where to initialise the weights (GPU init of 2.5B parameters takes seconds; CPU minutes).
    """
    if (out_dir / "model_index.json").is_file():
        return out_dir
    diffusers: Any = importlib.import_module("diffusers")
    from rlpost.models.tiny import assemble_sd3_pipeline
    from rlpost.models.tiny_text import build_text_encoders, sd3_tokenizers

    cfg = dict(SD35_MEDIUM_TRANSFORMER)
    if num_layers is not None:
        cfg["num_layers"] = num_layers
        cfg["dual_attention_layers"] = [i for i in cfg["dual_attention_layers"] if i < num_layers]
    clip_tok, vocab, t5_tok = sd3_tokenizers(clip_merges=1000, clip_max_length=77, t5_max_length=256)

    def clip(hidden: int, heads: int) -> dict[str, int]:
        return dict(
            hidden_size=hidden,
            intermediate_size=4 * hidden,
            num_attention_heads=heads,
            num_hidden_layers=1,
            projection_dim=hidden,
        )

    torch.manual_seed(0)
    with torch.device(device):
        transformer = diffusers.SD3Transformer2DModel(**cfg).to(torch.bfloat16)
        vae = diffusers.AutoencoderKL(**SD35_VAE)
        # SD3.5-sized text encoders (one layer each): the tiny stack with SD3.5's widths.
        t5 = dict(d_model=4096, d_kv=64, d_ff=10240, num_heads=64, relative_attention_num_buckets=32)
        te1, te2, te3 = build_text_encoders(
            vocab, len(t5_tok), clip_overrides=(clip(768, 12), clip(1280, 20)), t5_overrides=t5
        )
    pipe = assemble_sd3_pipeline(transformer, vae, (te1, te2, te3), clip_tok, t5_tok, shift=3.0)
    out_dir.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(str(out_dir))
    return out_dir


def write_recipes(directory: Path, model: str, args: argparse.Namespace) -> tuple[list[str], dict[str, list[str]]]:
    """Write the shared base and the four overlays; returns (base files, overlay files per algorithm)."""
    directory.mkdir(parents=True, exist_ok=True)
    base = {
        "run": {
            "seed": 0,
            "max_steps": 100000,
            "groups_per_step": args.groups,
            "samples_per_group": 12,
            "device": args.device,
            "max_grad_norm": 1.0,
            "progress": False,
        },
        "model": {
            "class_path": "sd3",
            "init_args": {
                "pretrained": model,
                "dtype": "bfloat16",
                "resolution": args.resolution,
                "guidance_scale": 4.5,
                "lora": {"rank": 64, "alpha": 64},
                "gradient_checkpointing": True,
            },
        },
        "prompts": {"class_path": "prompt-list", "init_args": {"prompts": PROMPTS}},
        "rewards": [{"class_path": args.reward}],
        "optimizer": {
            "class_path": "clipped-surrogate",
            "init_args": {
                "clip_range": 1.0e-4,
                "adv_clip_max": 5.0,
                "optimizer_steps": 1,
                "minibatch_edges": args.minibatch_edges,
            },
        },
        "torch_optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1.0e-5, "weight_decay": 0.01}},
        "eval": {
            "prompts": {"class_path": "prompt-list", "init_args": {"prompts": PROMPTS[:8]}},
            "num_steps": 10,
            "every": 0,
            "seed": 1000,
            "batch_size": 8,
            "save_images": True,
        },
        "checkpoint": {"every": 0, "keep_last": 1, "at_end": False},
    }
    chunk = args.chunk_size
    overlays = {
        "treegrpo": {
            "sampler": {
                "class_path": "tree",
                "init_args": {
                    "num_steps": 10,
                    "k": 3,
                    "depth": 3,
                    "window": "geometric",
                    "ratio": 0.5,
                    "kernel": "flow-sde",
                    "kernel_args": {"noise_level": 0.7},
                    "chunk_size": chunk,
                },
            },
            "advantage": {"class_path": "tree-backup"},
        },
        "dancegrpo": {
            "sampler": {
                "class_path": "dance",
                "init_args": {
                    "num_steps": 10,
                    "eta": 0.3,
                    "timestep_fraction": 0.6,
                    "init_same_noise": True,
                    "final_step": "ode",
                    "chunk_size": chunk,
                },
            },
            "advantage": {"class_path": "group-zscore"},
        },
        "mixgrpo": {
            "sampler": {
                "class_path": "mix",
                "init_args": {
                    "num_steps": 10,
                    "noise_level": 0.7,
                    "window_size": 2,
                    "shift_interval": 25,
                    "window_strategy": "progressive",
                    "window_stride": 1,
                    "roll_back": True,
                    "init_same_noise": True,
                    "dpm_after_window": False,
                    "shift": 3.0,
                    "chunk_size": chunk,
                },
            },
            "advantage": {"class_path": "group-zscore"},
        },
        "ddpo": {
            "sampler": {
                "class_path": "ddpo",
                "init_args": {
                    "num_steps": 10,
                    "noise_level": 0.7,
                    "timestep_fraction": 1.0,
                    "final_step": "ode",
                    "chunk_size": chunk,
                },
            },
            "advantage": {"class_path": "per-prompt", "init_args": {"buffer_size": 16, "min_count": 16}},
        },
    }
    (directory / "base.yaml").write_text(yaml.safe_dump(base, sort_keys=False))
    files: dict[str, list[str]] = {}
    for name, overlay in overlays.items():
        (directory / f"{name}.yaml").write_text(yaml.safe_dump(overlay, sort_keys=False))
        files[name] = [str(directory / f"{name}.yaml")]
    return [str(directory / "base.yaml")], files


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, skip without CUDA, build or find the model, run the bench, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/bench-sd35-gpu")
    parser.add_argument("--model", default="auto", help="auto (real SD3.5-M if cached, else random), or a path/id")
    parser.add_argument("--build-dir", default=str(Path.home() / ".cache" / "rlpost" / "sd35m-random"))
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--groups", type=int, default=4, help="prompt groups per iteration (paper: 32)")
    parser.add_argument("--time-budget-s", type=float, default=600.0, help="training time per algorithm")
    parser.add_argument("--max-iterations", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--reward", default="jpeg-compressibility")
    parser.add_argument("--chunk-size", type=int, default=32, help="rows per rollout forward")
    parser.add_argument("--minibatch-edges", type=int, default=39, help="edges per training forward+backward")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=None, help="override transformer depth (CPU smoke test only)")
    parser.add_argument("--allow-cpu", action="store_true", help="run without CUDA (plumbing smoke test only)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("benchmarks/gpu_sd35.py: no CUDA device; skipping (nothing to measure on CPU at 512 px)")
        return 0
    if args.allow_cpu and not torch.cuda.is_available():
        args.device = "cpu"
    model = args.model
    if model == "auto":
        model = real_model_available() or ""
        if not model:
            print(f"SD3.5-medium not in the local HF cache: building a random-weight pipeline in {args.build_dir}")
            model = str(build_random_sd35(Path(args.build_dir), args.layers, args.device))
    print(f"model: {model}", file=sys.stderr)
    from rlpost.bench import AlgoSpec, Bench, BenchSpec, markdown

    out = Path(args.out)
    base, overlays = write_recipes(out / "recipes", model, args)
    labels = {"treegrpo": "TreeGRPO", "dancegrpo": "DanceGRPO", "mixgrpo": "MixGRPO", "ddpo": "DDPO"}
    spec = BenchSpec(
        output_dir=str(out),
        base=base,
        algorithms=[AlgoSpec(name, labels[name], files) for name, files in overlays.items()],
        schedule="least-time",
        time_budget_s=args.time_budget_s,
        max_iterations=args.max_iterations,
        eval_every=args.eval_every,
        reference="dancegrpo",
        fast="treegrpo",
        calibration_repeats=3,
        calibration_batch_sizes=[1, 4, 13, 32],
    )
    result = Bench(spec).run()
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
