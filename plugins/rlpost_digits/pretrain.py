"""Pretrain the digits world's text-to-image model: a tiny ``StableDiffusion3Pipeline`` on sklearn digits.

The result is an ordinary diffusers pipeline directory (``save_pretrained``, safetensors) that
``SD3Policy(pretrained="assets/digits-sd3", resolution=16, max_sequence_length=8)`` loads through
``StableDiffusion3Pipeline.from_pretrained``. See ``docs/digits.md`` for the design; in short:

* **Transformer**: ``SD3Transformer2DModel``, 4 joint blocks, 4 heads x 32, but patch 4
  on 16x16x1 -> 16 image tokens (each covers 2x2 pixels of the 8x8 source digit), trained from scratch with
  rectified flow matching. Patch 4 instead of 2 cuts a step ~2.5x with the 24 text tokens (16 CLIP + 8 T5).
* **VAE = identity**: an ``AutoencoderKL`` with one block (scale factor 1) and one latent channel whose weights are
  *set in closed form* (not trained) so that ``decode(z)`` is ``z`` on all three RGB channels, to within 1e-3. The
  transformer therefore works in pixel space (``x0`` = the digit in ``[-1, 1]``), which trains fastest on 2 cores,
  and the pipeline's usual ``latents / scaling_factor + shift_factor -> vae.decode`` path is untouched
  (scaling 1, shift 0). See :func:`identity_vae`.
* **Text**: the real SD3 stack (two ``CLIPTextModelWithProjection`` + ``T5EncoderModel``) at tiny size with locally
  built tokenizers, randomly initialised from the seed and **frozen**: random encoders still map each prompt to a
  distinct embedding, so the transformer learns the mapping; freezing lets the prompt embeddings be computed once
  with the pipeline's own ``encode_prompt`` (the exact path ``SD3Policy`` uses), which keeps a step as cheap as
  label conditioning. CLIP prompts are 16 tokens (the tokenizer's ``model_max_length``) and T5 prompts must be
  sampled with ``max_sequence_length=8``, the length used here (T5 runs without a padding mask in the SD3 pipeline,
  so a different length changes every embedding).
* **Objective**: ``x_σ = (1-σ)·x0 + σ·ε``, target ``v = ε - x0``, ``timestep = 1000·σ`` (what ``SD3Policy`` and the
  flow-match Euler scheduler use); σ from a logit-normal(0, 1) mixed with 20 % uniform so the ends of the schedule
  are trained too. The prompt is replaced by the empty prompt 10 % of the time, so classifier-free guidance works
  with ``negative_prompt=""``. AdamW, warm-up + cosine decay, EMA of the weights (the EMA is what is saved).

Command line (deterministic for a given seed, thread count and machine)::

    python -m rlpost_digits.pretrain --out assets/digits-sd3 --steps 900
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rlpost import assemble_sd3_pipeline, build_text_encoders, sd3_tokenizers, t5_vocab
from rlpost_digits.data import RESOLUTION, TRAIN_TEMPLATES, load_split, prompts_for, upsample_digits

__all__ = ["MAX_SEQUENCE_LENGTH", "build_digits_pipeline", "identity_vae", "main", "pretrain"]

MAX_SEQUENCE_LENGTH = 8
"""T5 tokens per prompt, used in pretraining; sample with ``SD3Policy(max_sequence_length=8)``."""
CLIP_MAX_LENGTH = 16
"""CLIP tokens per prompt (the CLIP tokenizers' ``model_max_length``, which the SD3 pipeline always pads to)."""
SCHEDULER_SHIFT = 1.0
"""Static time shift of the saved scheduler. 16x16 images need no shift towards high noise (SD3's 3.0 is for
1024 px); with 1.0 an NFE-10 Euler run spends its steps evenly in σ."""
PATCH_SIZE = 4
"""Transformer patch size (16 image tokens at 16x16)."""
META_FILE = "rlpost_digits.json"
"""Training provenance written next to ``model_index.json`` (diffusers ignores unknown files)."""

# Words of the prompt templates, added to the tiny T5 vocabulary so prompts stay short (no character fallback).
_EXTRA_T5_WORDS = ("handwritten", "written", "hand", "drawn", "by", "figure", "numeral", "write")


def identity_vae(bias: float = 32.0) -> nn.Module:
    """An ``AutoencoderKL`` (scale factor 1, one latent channel) whose ``decode`` copies the latent to RGB.

    No training: every weight is set in closed form. Each ``ResnetBlock2D`` and attention block is made an identity
    by zeroing its last projection (they are residual). What remains is ``conv_in -> GroupNorm -> SiLU -> conv_out``:

    * ``conv_in`` writes four channels ``[z, -z, b, -b]``. Their mean is exactly 0 and their variance
      ``(E[z²] + b²)/2``, so the single-group ``GroupNorm`` (scaled by ``b/√2``) returns ``±z/√(1 + E[z²]/b²)``,
      i.e. ``±z`` up to a relative 1/(2b²) (< 5e-4 for ``b = 32`` and ``|z| ≤ 1``).
    * ``SiLU(u) - SiLU(-u) = u`` exactly, so ``conv_out`` taking channel 0 minus channel 1 undoes the nonlinearity.

    The encoder is built the same way and returns the RGB mean as the latent mean (log-variance -20), so
    ``encode`` then ``decode`` maps a gray image to itself.

    Args:
        bias: The constant channels' magnitude ``b`` (larger is more exact; 32 keeps bf16 use reasonable).
    """
    diffusers: Any = importlib.import_module("diffusers")
    vae = diffusers.AutoencoderKL(
        sample_size=RESOLUTION,
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
        block_out_channels=(4,),
        layers_per_block=1,
        latent_channels=1,
        norm_num_groups=1,
        scaling_factor=1.0,
        shift_factor=0.0,
        use_quant_conv=False,
        use_post_quant_conv=False,
        mid_block_add_attention=False,
        force_upcast=False,
    )
    with torch.no_grad():
        for p in vae.parameters():
            p.zero_()
        for module in vae.modules():
            if isinstance(module, nn.GroupNorm):
                module.weight.fill_(1.0)  # inner norms feed zeroed branches; any value works
        for coder, in_ch in ((vae.encoder, 3), (vae.decoder, 1)):
            w = coder.conv_in.weight  # [4, in_ch, 3, 3]; the centre tap makes it a per-pixel linear map
            w[0, :, 1, 1] = 1.0 / in_ch  # z (the decoder's latent, or the encoder's RGB mean)
            w[1, :, 1, 1] = -1.0 / in_ch
            coder.conv_in.bias.copy_(torch.tensor([0.0, 0.0, bias, -bias]))
            coder.conv_norm_out.weight.copy_(torch.tensor([bias / math.sqrt(2.0)] * 2 + [0.0, 0.0]))
            out = coder.conv_out.weight  # [C_out, 4, 3, 3]
            if coder is vae.decoder:
                out[:, 0, 1, 1] = 1.0
                out[:, 1, 1, 1] = -1.0
            else:  # 2 channels: latent mean, log-variance (a near-deterministic encoder)
                out[0, 0, 1, 1] = 1.0
                out[0, 1, 1, 1] = -1.0
                coder.conv_out.bias.copy_(torch.tensor([0.0, -20.0]))
    vae.eval()
    module_: nn.Module = vae
    return module_


def build_digits_pipeline(seed: int = 0) -> Any:
    """A fresh ``StableDiffusion3Pipeline`` for the digits world: random transformer and text encoders, identity VAE.

    Args:
        seed: Seeds every random weight (transformer and the frozen text encoders).
    """
    diffusers: Any = importlib.import_module("diffusers")
    clip_tok, vocab_size, t5_tok = sd3_tokenizers(
        t5_vocab(_EXTRA_T5_WORDS), clip_merges=1000, clip_max_length=CLIP_MAX_LENGTH, t5_max_length=MAX_SEQUENCE_LENGTH
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = diffusers.SD3Transformer2DModel(
            sample_size=RESOLUTION,
            patch_size=PATCH_SIZE,
            in_channels=1,
            out_channels=1,
            num_layers=4,
            attention_head_dim=32,
            num_attention_heads=4,
            joint_attention_dim=64,
            caption_projection_dim=128,
            pooled_projection_dim=64,
            pos_embed_max_size=RESOLUTION // PATCH_SIZE,
        )
        te1, te2, te3 = build_text_encoders(
            vocab_size,
            len(t5_tok),
            clip_intermediate=64,
            clip_max_positions=CLIP_MAX_LENGTH,
            t5_d_model=64,
            t5_d_kv=16,
            t5_d_ff=128,
        )
    vae = identity_vae()
    for module in (transformer, te1, te2, te3, vae):
        module.requires_grad_(False)
    # eval() as well: CLIP/T5 dropout would make embeddings differ from the reloaded pipeline.
    return assemble_sd3_pipeline(transformer, vae, (te1, te2, te3), clip_tok, t5_tok, SCHEDULER_SHIFT)


@torch.no_grad()
def _encode(pipe: Any, prompts: list[str]) -> tuple[Tensor, Tensor]:
    pe, _, pooled, _ = pipe.encode_prompt(
        prompt=prompts,
        prompt_2=None,
        prompt_3=None,
        device=torch.device("cpu"),
        num_images_per_prompt=1,
        do_classifier_free_guidance=False,
        max_sequence_length=MAX_SEQUENCE_LENGTH,
    )
    return pe.float(), pooled.float()


def _lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))  # cosine down to 10 %


def pretrain(
    out: Path,
    *,
    steps: int = 900,
    batch_size: int = 128,
    lr: float = 1e-3,
    seed: int = 0,
    cfg_dropout: float = 0.1,
    ema_decay: float = 0.99,
    warmup: int = 50,
    save_dtype: torch.dtype = torch.float16,
    log_every: int = 50,
    save_every: int = 0,
) -> dict[str, Any]:
    """Train the digits transformer and save the pipeline to ``out``.

    Args:
        out: Output pipeline directory (created; existing files are overwritten).
        steps: Optimizer steps.
        batch_size: Images per step; each gets a random training template and its digit's prompt.
        lr: Peak AdamW learning rate.
        seed: Seeds the weights, the data order, the noise and the σ draws.
        cfg_dropout: Probability of replacing a prompt with the empty prompt (for classifier-free guidance).
        ema_decay: Decay of the weight EMA that is saved (0 saves the raw weights).
        warmup: Linear warm-up steps.
        save_dtype: dtype of the saved transformer weights (fp16 halves the asset; ``from_pretrained`` upcasts).
        log_every: Print the running loss every this many steps (0: never).
        save_every: Also save the (EMA) pipeline to ``out`` every this many steps (0: only at the end), so a long
            run can be inspected or stopped early.

    Returns:
        The provenance written to ``out/rlpost_digits.json``.
    """
    t_start = time.perf_counter()
    pipe = build_digits_pipeline(seed)
    images, labels = load_split("train")
    x_all = upsample_digits(images)  # [N, 1, 16, 16] in [-1, 1]

    # Frozen encoders: every distinct prompt is encoded once, through the pipeline's own encode_prompt.
    table = [[p for p, d in prompts_for(TRAIN_TEMPLATES) if d == digit] for digit in range(10)]
    flat = [p for row in table for p in row]
    pe, pooled = _encode(pipe, [*flat, ""])
    n_templates = len(TRAIN_TEMPLATES)
    empty_row = len(flat)

    transformer = pipe.transformer
    transformer.requires_grad_(True).train()
    ema = copy.deepcopy(transformer).requires_grad_(False).eval() if ema_decay > 0 else None
    opt = torch.optim.AdamW(transformer.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed + 1)

    meta: dict[str, Any] = {
        "world": "rlpost digits (sklearn load_digits)",
        "resolution": RESOLUTION,
        "max_sequence_length": MAX_SEQUENCE_LENGTH,
        "orientation": "bright strokes on a dark background (sklearn's)",
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "seed": seed,
        "cfg_dropout": cfg_dropout,
        "ema_decay": ema_decay,
        "train_templates": list(TRAIN_TEMPLATES),
        "torch_threads": torch.get_num_threads(),
    }
    out = Path(out)
    running = 0.0
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, steps, lr, warmup)
        idx = torch.randint(0, x_all.shape[0], (batch_size,), generator=gen)
        x0, y = x_all[idx], labels[idx]
        template = torch.randint(0, n_templates, (batch_size,), generator=gen)
        rows = y * n_templates + template
        rows = torch.where(torch.rand(batch_size, generator=gen) < cfg_dropout, empty_row, rows)
        # σ: logit-normal(0, 1) (SD3's choice) with 20 % uniform mixed in so σ near 0 and 1 are trained as well.
        sigma = torch.sigmoid(torch.randn(batch_size, generator=gen))
        sigma = torch.where(torch.rand(batch_size, generator=gen) < 0.2, torch.rand(batch_size, generator=gen), sigma)
        noise = torch.randn(x0.shape, generator=gen)
        s = sigma.view(-1, 1, 1, 1)
        x_sigma = (1 - s) * x0 + s * noise
        pred = transformer(
            hidden_states=x_sigma,
            timestep=sigma * 1000.0,  # the scheduler's timestep = 1000·σ
            encoder_hidden_states=pe[rows],
            pooled_projections=pooled[rows],
            return_dict=False,
        )[0]
        loss = torch.nn.functional.mse_loss(pred, noise - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        opt.step()
        if ema is not None:
            with torch.no_grad():
                decay = min(ema_decay, (1 + step) / (10 + step))  # short warm-up of the EMA itself
                for pe_, p in zip(ema.parameters(), transformer.parameters(), strict=True):
                    pe_.lerp_(p, 1 - decay)
        running += loss.item()
        if log_every and (step + 1) % log_every == 0:
            elapsed = time.perf_counter() - t_start
            print(f"step {step + 1}/{steps} loss {running / log_every:.4f} {elapsed:.0f}s", flush=True)
            running = 0.0

        if save_every and (step + 1) % save_every == 0 and step + 1 < steps:
            _save(pipe, ema if ema is not None else transformer, out, save_dtype, {**meta, "steps_done": step + 1})

    meta["wall_time_s"] = round(time.perf_counter() - t_start, 1)
    meta["steps_done"] = steps
    _save(pipe, ema if ema is not None else transformer, out, save_dtype, meta)
    return meta


def _save(pipe: Any, transformer: nn.Module, out: Path, dtype: torch.dtype, meta: dict[str, Any]) -> None:
    """Save ``pipe`` with ``transformer`` (a copy cast to ``dtype``) in place of the training transformer."""
    trained = pipe.transformer
    final = copy.deepcopy(transformer).eval().requires_grad_(False).to(dtype)
    pipe.register_modules(transformer=final)
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(str(out))
    pipe.register_modules(transformer=trained)
    (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description="Pretrain the digits-world SD3 pipeline (rectified flow, CPU).")
    parser.add_argument("--out", type=Path, required=True, help="output pipeline directory")
    parser.add_argument("--steps", type=int, default=900)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ema-decay", type=float, default=0.99)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--save-every", type=int, default=0, help="also save every N steps (0: only at the end)")
    parser.add_argument("--save-fp32", action="store_true", help="save fp32 transformer weights (default fp16)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    meta = pretrain(
        args.out,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        ema_decay=args.ema_decay,
        save_dtype=torch.float32 if args.save_fp32 else torch.float16,
        log_every=args.log_every,
        save_every=args.save_every,
    )
    print(json.dumps(meta, indent=2))


if __name__ == "__main__":
    main()
