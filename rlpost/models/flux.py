"""FLUX.1 (dev / schnell) as an rlpost :class:`~rlpost.core.api.Policy`, on the real diffusers stack.

Everything FLUX specific lives here: loading ``FluxPipeline``, prompt encoding (CLIP pooled + T5 sequence), the
``FluxTransformer2DModel`` call (2x2-packed latent tokens with ``img_ids`` / ``txt_ids``, timestep as ``σ``, the
distilled guidance scale as a transformer input), the resolution-dependent time shift and the VAE scaling/shift.

The seam is unchanged from SD3: samplers and kernels see image-shaped latents ``[B, C, H/f, W/f]``. Packing into
``[B, (H/2f)(W/2f), 4C]`` tokens happens inside :meth:`FluxPolicy.velocity` and is undone before it returns, so every
step kernel, log-prob reduction (a mean or sum over all latent elements is the same in either layout) and sampler
works on FLUX without knowing it.

With the Euler ODE kernel and the default ``time_grid="diffusers"``, sampling through this adapter reproduces
``FluxPipeline.__call__`` (same sigmas, ``mu`` from the image sequence length, timestep ``σ``, guidance input,
packing); the test suite checks this on a tiny model.
"""

from __future__ import annotations

import copy
import inspect
import json
import math
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor, nn

from rlpost.core.api import Conditioning, Policy
from rlpost.core.hookspecs import hookimpl
from rlpost.core.registry import Registry
from rlpost.models._common import (
    DTypeName,
    LoraSpec,
    ModelDirError,
    PromptCache,
    cached_snapshot,
    check_pipeline_dir,
    is_local_path,
    resolve_dtype,
)
from rlpost.models.tiny import ensure_tiny_flux, parse_tiny_id
from rlpost.ops.schedules import TIME_GRIDS, TimeGrid, shifted_linspace_sigmas, timesteps_from_sigmas

__all__ = ["FluxPolicy", "flux_mu", "flux_sigmas", "pack_latents", "rlpost_register_models", "unpack_latents"]

_FLUX_REQUIRED = ("transformer", "vae", "scheduler", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
_FLUX_WEIGHTED = ("transformer", "vae", "text_encoder", "text_encoder_2")


def pack_latents(latents: Tensor) -> Tensor:
    """``[B, C, h, w]`` -> ``[B, (h/2)(w/2), 4C]`` 2x2 patch tokens, in ``FluxPipeline._pack_latents``' order."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: Tensor, h: int, w: int) -> Tensor:
    """Inverse of :func:`pack_latents` (``FluxPipeline._unpack_latents``): tokens back to ``[B, C, h, w]``."""
    b, _, d = tokens.shape
    x = tokens.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, h, w)


def flux_mu(image_seq_len: int, scheduler_config: Any) -> float:
    """The dynamic-shift parameter ``mu``: linear in the number of image tokens, as ``FluxPipeline`` computes it
    (diffusers ``pipelines/flux/pipeline_flux.py`` ``calculate_shift``), from the scheduler config's
    ``base_image_seq_len`` / ``max_image_seq_len`` / ``base_shift`` / ``max_shift`` (FLUX.1: 256 / 4096 / 0.5 / 1.15).
    """
    get = scheduler_config.get
    base_len, max_len = int(get("base_image_seq_len", 256)), int(get("max_image_seq_len", 4096))
    base_shift, max_shift = float(get("base_shift", 0.5)), float(get("max_shift", 1.15))
    m = (max_shift - base_shift) / (max_len - base_len)
    return image_seq_len * m + (base_shift - m * base_len)


def flux_sigmas(num_steps: int, mu: float, scheduler_config: Any) -> Tensor:
    """``[num_steps + 1]`` fp32 noise levels of ``FluxPipeline``: ``linspace(1, 1/T, T)`` handed to the pipeline's
    ``FlowMatchEulerDiscreteScheduler.set_timesteps(sigmas=..., mu=mu)``, then the appended 0.

    The scheduler itself does the shifting (exponential ``e^mu / (e^mu + 1/σ - 1)`` with dynamic shifting, which is
    SD3's static shift with ``s = e^mu``; the config's static ``shift`` otherwise), so every scheduler option the
    model ships with is honoured exactly.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler

    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    scheduler: Any = FlowMatchEulerDiscreteScheduler.from_config(dict(scheduler_config))  # type: ignore[no-untyped-call]
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu, device="cpu")
    sigmas: Tensor = scheduler.sigmas.to(torch.float32)
    return sigmas


class FluxPolicy(Policy):
    """FLUX.1 (rectified-flow MMDiT with packed latents) loaded with ``FluxPipeline.from_pretrained``.

    Args:
        pretrained: Hub id (e.g. ``black-forest-labs/FLUX.1-dev``, resolved from the local HF cache), a local
            pipeline directory, or ``tiny-random[:SEED]`` (a tiny random-weight FLUX built on first use).
        dtype: Weight dtype. ``auto`` = bfloat16 on CUDA, float32 on CPU. Means and log-probs are fp32 either way.
        resolution: Image height and width in pixels (a multiple of 2 x the VAE factor: 16 for FLUX.1).
        guidance_scale: FLUX.1-dev's distilled guidance, fed to the transformer's guidance embedding (one forward
            per row; there is no classifier-free guidance pass). Ignored by models without a guidance embedding
            (FLUX.1-schnell). FluxPipeline's default and DanceGRPO's value: 3.5.
        lora: Train a LoRA adapter on the transformer with these settings; ``null`` for none.
        full_finetune: Train every transformer parameter instead of a LoRA adapter.
        gradient_checkpointing: Recompute transformer activations in the backward pass to save memory.
        reference: Keep a frozen reference model for KL terms. LoRA always has one for free (adapter disabled);
            full fine-tuning needs this flag and keeps a frozen copy of the transformer.
        max_sequence_length: T5 tokens per prompt (FluxPipeline's default 512).
        local_files_only: Never contact the hub; hub ids must already be in the local cache.
        time_grid: ``"diffusers"`` (default): ``FluxPipeline``'s grid, ``linspace(1, 1/T, T)`` shifted with
            ``mu`` from the image sequence length (resolution-dependent). ``"shifted-linspace"``:
            ``time_shift(linspace(1, 0, T+1), shift)``, DanceGRPO's and MixGRPO's static grid. See
            ``docs/models.md`` "Time grids".
        shift: Static shift of ``"shifted-linspace"`` (``null``: the scheduler config's ``shift``, 3.0 for FLUX.1,
            which is DanceGRPO's and MixGRPO's ``--shift 3``). Must be ``null`` with ``"diffusers"``, whose shift is
            ``e^mu``.
    """

    name: ClassVar[str] = "flux"

    def __init__(
        self,
        pretrained: str,
        dtype: DTypeName = "auto",
        resolution: int = 512,
        guidance_scale: float = 3.5,
        lora: LoraSpec | None = None,
        full_finetune: bool = False,
        gradient_checkpointing: bool = False,
        reference: bool = False,
        max_sequence_length: int = 512,
        local_files_only: bool = True,
        time_grid: TimeGrid = "diffusers",
        shift: float | None = None,
    ) -> None:
        if lora is not None and full_finetune:
            raise ValueError("FluxPolicy: choose either lora or full_finetune, not both")
        self.pretrained = pretrained
        self.dtype_name: DTypeName = dtype
        self.resolution = int(resolution)
        self.guidance_scale = float(guidance_scale)
        self.lora = lora
        self.full_finetune = bool(full_finetune)
        self.gradient_checkpointing = bool(gradient_checkpointing)
        self.use_reference = bool(reference)
        self.max_sequence_length = int(max_sequence_length)
        self.local_files_only = bool(local_files_only)
        self.time_grid: TimeGrid = time_grid
        self.shift = None if shift is None else float(shift)
        self.forward_count: int = 0
        """Transformer evaluations in batch rows, summed over :meth:`velocity` calls."""
        self._pipe: Any = None  # FluxPipeline (untyped for mypy)
        self._device = torch.device("cpu")
        self._dtype = torch.float32
        self._ref_transformer: nn.Module | None = None
        self._use_ref = False
        self._cache = PromptCache()
        self._img_ids: Tensor | None = None
        self._sigmas: dict[int, Tensor] = {}

    # ------------------------------------------------------------------------------------------------ set-up

    def clean_tail_steps(self) -> int:
        """Both FLUX grids end ``shift(1/T) -> 0`` (no ``σ_min`` level): only the final step lands on a clean level."""
        return 1

    def validate(self, recipe: Any) -> list[str]:
        """Check the settings, the model directory (local, or a hub id's snapshot in the local cache) and that the
        resolution fits the VAE and the 2x2 packing, without loading weights."""
        problems: list[str] = []
        if self.resolution <= 0:
            problems.append(f"model.init_args.resolution: must be positive, got {self.resolution}")
        if not math.isfinite(self.guidance_scale) or self.guidance_scale < 0:
            problems.append(f"model.init_args.guidance_scale: must be a finite number >= 0, got {self.guidance_scale}")
        if self.max_sequence_length < 1:
            problems.append(f"model.init_args.max_sequence_length: must be >= 1, got {self.max_sequence_length}")
        if self.lora is not None:
            problems.extend(self.lora.problems("model.init_args.lora"))
        if self.time_grid not in TIME_GRIDS:
            problems.append(f"model.init_args.time_grid: must be one of {list(TIME_GRIDS)}, got {self.time_grid!r}")
        if self.shift is not None:
            if not self.shift > 0:
                problems.append(f"model.init_args.shift: must be > 0 (or null for the scheduler's), got {self.shift}")
            elif self.time_grid == "diffusers":
                problems.append(
                    "model.init_args.shift: the 'diffusers' FLUX grid shifts by e^mu from the resolution; set "
                    "shift only with time_grid 'shifted-linspace' (or leave it null)"
                )
        try:
            tiny = parse_tiny_id(self.pretrained)
        except ValueError as e:
            return [*problems, f"model.init_args.pretrained: {e}"]
        if tiny is not None:
            return problems + self._resolution_problems(2)  # the tiny FLUX has VAE factor 2 (rlpost/models/tiny.py)
        try:
            if is_local_path(self.pretrained):
                directory = Path(self.pretrained).expanduser()
            elif self.local_files_only:
                directory = cached_snapshot(self.pretrained)
            else:
                return problems
            check_pipeline_dir(directory, _FLUX_REQUIRED, _FLUX_WEIGHTED)
        except ModelDirError as e:
            return [*problems, f"model.init_args.pretrained: {e}"]
        try:
            vae = json.loads((directory / "vae" / "config.json").read_text(encoding="utf-8"))
            vae_factor = 2 ** (len(vae["block_out_channels"]) - 1)
        except (OSError, ValueError, KeyError, TypeError):
            return problems  # no readable VAE config: setup() checks the loaded model
        return problems + self._resolution_problems(vae_factor)

    def _resolution_problems(self, vae_factor: int) -> list[str]:
        factor = 2 * vae_factor
        if self.resolution > 0 and self.resolution % factor:
            return [
                f"model.init_args.resolution: {self.resolution} is not a multiple of {factor} "
                f"(VAE factor {vae_factor} x 2x2 latent packing)"
            ]
        return []

    def setup(self, device: torch.device) -> None:
        """Load the pipeline, move it to ``device`` in the weight dtype and prepare LoRA / full FT / reference.

        Raises:
            ModelDirError: The local directory is missing or malformed (the message names what is missing).
            OSError: diffusers could not load the model (wrapped with the path or hub id).
        """
        from diffusers import FluxPipeline

        device = torch.device(device)
        self._device = device
        self._dtype = resolve_dtype(self.dtype_name, device)
        source = self.pretrained
        tiny = parse_tiny_id(source)
        if tiny is not None:
            source = str(ensure_tiny_flux(tiny))
        elif is_local_path(source):
            check_pipeline_dir(Path(source), _FLUX_REQUIRED, _FLUX_WEIGHTED)
            source = str(Path(source).expanduser())
        _quiet_hf_progress_bars()
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*torch_dtype.*", category=FutureWarning)
                pipe: Any = FluxPipeline.from_pretrained(  # type: ignore[no-untyped-call]
                    source, torch_dtype=self._dtype, local_files_only=self.local_files_only
                )
        except Exception as e:  # diffusers raises OSError/ValueError/EnvironmentError with terse messages
            where = "local directory" if is_local_path(self.pretrained) else "hub id (local cache only)"
            raise OSError(f"FluxPolicy: could not load {where} {self.pretrained!r}: {type(e).__name__}: {e}") from e
        pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        for module in self._modules(pipe):
            module.eval()  # inference-mode encoders/VAE; train() below only toggles the transformer
            module.requires_grad_(False)
        factor = pipe.vae_scale_factor * 2
        if self.resolution % factor:
            raise ValueError(
                f"resolution {self.resolution} must be a multiple of {factor} (VAE factor x 2x2 latent packing)"
            )
        transformer = pipe.transformer
        if self.lora is not None:
            transformer.add_adapter(self.lora.to_peft())
            for p in transformer.parameters():
                if p.requires_grad:
                    p.data = p.data.float()  # trainable adapter weights in fp32 (diffusers' cast_training_params)
        elif self.full_finetune:
            if self.use_reference:
                self._ref_transformer = copy.deepcopy(transformer).requires_grad_(False).eval()
            transformer.requires_grad_(True)
        if self.gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
        self._pipe = pipe
        h, w = self.latent_shape[1:]
        # FluxPipeline._prepare_latent_image_ids: (0, row, col) per 2x2 token, in the transformer's dtype.
        ids = torch.zeros(h // 2, w // 2, 3)
        ids[..., 1] += torch.arange(h // 2)[:, None]
        ids[..., 2] += torch.arange(w // 2)[None, :]
        self._img_ids = ids.reshape(-1, 3).to(device, self._dtype)
        self._cache.clear()
        self._sigmas.clear()

    @staticmethod
    def _modules(pipe: Any) -> list[nn.Module]:
        names = ("transformer", "vae", "text_encoder", "text_encoder_2")
        return [m for m in (getattr(pipe, n, None) for n in names) if m is not None]

    @property
    def pipe(self) -> Any:
        """The loaded diffusers pipeline."""
        if self._pipe is None:
            raise RuntimeError("FluxPolicy.setup(device) has not been called")
        return self._pipe

    @property
    def transformer(self) -> Any:
        """The (trainable) ``FluxTransformer2DModel``."""
        return self.pipe.transformer

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def weight_dtype(self) -> torch.dtype:
        """dtype of the loaded weights."""
        return self._dtype

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """``(C, H/f, W/f)`` of one *unpacked* latent (``C`` = transformer channels / 4)."""
        f = self.pipe.vae_scale_factor
        side = 2 * (self.resolution // (2 * f))
        return (self.transformer.config.in_channels // 4, side, side)

    @property
    def image_seq_len(self) -> int:
        """Number of packed image tokens, ``(H/2f)·(W/2f)``: what ``mu`` is computed from."""
        _, h, w = self.latent_shape
        return (h // 2) * (w // 2)

    @property
    def mu(self) -> float:
        """The resolution-dependent shift parameter of the ``"diffusers"`` grid (:func:`flux_mu`)."""
        return flux_mu(self.image_seq_len, self.pipe.scheduler.config)

    # ------------------------------------------------------------------------------------------------ policy

    def sigmas(self, num_steps: int) -> Tensor:
        """``"diffusers"``: exactly ``FluxPipeline``'s sigmas at this resolution (:func:`flux_sigmas` with
        :attr:`mu`); ``"shifted-linspace"``: DanceGRPO's/MixGRPO's static grid with ``shift`` (else the config's)."""
        cfg = self.pipe.scheduler.config
        if self.time_grid == "diffusers":
            if num_steps not in self._sigmas:  # a scheduler per call is cheap, but samplers ask every rollout
                self._sigmas[num_steps] = flux_sigmas(num_steps, self.mu, cfg)
            return self._sigmas[num_steps].to(self.device, copy=True)
        shift = float(cfg.shift) if self.shift is None else self.shift
        return shifted_linspace_sigmas(num_steps, shift).to(self.device)

    def initial_noise(self, num: int, generator: torch.Generator) -> Tensor:
        """``[num, C, H/f, W/f]`` fp32 noise, drawn in the unpacked shape as ``FluxPipeline.prepare_latents`` does
        (so the same generator gives the pipeline's noise, before packing)."""
        noise = torch.randn((num, *self.latent_shape), generator=generator, device=generator.device)
        return noise.to(self.device, torch.float32)

    def encode(self, prompts: Sequence[str]) -> Conditioning:
        """Encode prompts with the pipeline's ``encode_prompt`` (CLIP pooled + T5), cached per prompt string.

        ``Conditioning.tensors`` holds ``prompt_embeds`` ``[B, L, D]`` (T5) and ``pooled_prompt_embeds`` ``[B, P]``
        (CLIP). ``text_ids`` are all zeros and rebuilt from ``L`` in :meth:`velocity`.
        """
        return Conditioning(self._cache.get(list(prompts), self._encode_batch))

    @torch.no_grad()
    def _encode_batch(self, prompts: list[str]) -> dict[str, Tensor]:
        pe, pp, _ = self.pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            device=self.device,
            num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
        )
        return {"prompt_embeds": pe, "pooled_prompt_embeds": pp}

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning) -> Tensor:
        """Velocity at ``(latents, σ)`` in fp32, image-shaped like ``latents``.

        Packs the latents into 2x2 tokens, calls the transformer with ``timestep = (1000·σ)/1000`` (as the pipeline
        rounds it), the guidance scale (guidance-distilled models) and the position ids, and unpacks the output.

        Args:
            latents: ``[B, C, h, w]`` states.
            sigma: ``[B]`` noise levels.
            cond: ``B`` rows of conditioning from :meth:`encode` (``Conditioning.select``).
        """
        b, _, h, w = latents.shape
        t = cond.tensors
        if t["prompt_embeds"].shape[0] != b:
            raise ValueError(f"velocity: {b} latents but {t['prompt_embeds'].shape[0]} conditioning rows")
        if self._img_ids is None:
            raise RuntimeError("FluxPolicy.setup(device) has not been called")
        sigma = sigma.to(self.device, torch.float32).reshape(-1).expand(b)
        tokens = pack_latents(latents.to(self.device, self._dtype))
        # FluxPipeline: t = 1000·σ (fp32), cast to the latents' dtype, then divided by 1000.
        timestep = timesteps_from_sigmas(sigma).to(self._dtype) / 1000
        transformer: Any = (
            self._ref_transformer if (self._use_ref and self._ref_transformer is not None) else self.transformer
        )
        guidance = None
        if transformer.config.guidance_embeds:
            guidance = torch.full((b,), self.guidance_scale, device=self.device, dtype=torch.float32)
        enc = t["prompt_embeds"].to(self._dtype)
        txt_ids = torch.zeros(enc.shape[1], 3, device=self.device, dtype=self._dtype)
        out: Tensor = transformer(
            hidden_states=tokens,
            timestep=timestep,
            guidance=guidance,
            pooled_projections=t["pooled_prompt_embeds"].to(self._dtype),
            encoder_hidden_states=enc,
            txt_ids=txt_ids,
            img_ids=self._img_ids,
            return_dict=False,
        )[0]
        self.forward_count += b
        return unpack_latents(out, h, w).float()

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """VAE-decode clean latents (``x / scaling_factor + shift_factor``) to ``[B, H, W, 3]`` uint8 on the device."""
        vae = self.pipe.vae
        x = latents.to(self.device, torch.float32) / vae.config.scaling_factor + vae.config.shift_factor
        img: Tensor = vae.decode(x.to(vae.dtype), return_dict=False)[0].float()
        img = (img / 2 + 0.5).clamp(0, 1)  # VaeImageProcessor.postprocess, then numpy_to_pil's round(x*255)
        return (img * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()

    def trainable_parameters(self) -> list[nn.Parameter]:
        """LoRA adapter parameters, or every transformer parameter under full fine-tuning; empty when frozen."""
        if self.lora is None and not self.full_finetune:
            return []
        return [p for p in self.transformer.parameters() if p.requires_grad]

    @contextmanager
    def _reference_ctx(self) -> Iterator[None]:
        if self.lora is not None:
            self.transformer.disable_adapters()
            try:
                yield
            finally:
                self.transformer.enable_adapters()
        else:
            self._use_ref = True
            try:
                yield
            finally:
                self._use_ref = False

    def reference(self) -> Any:
        """Context in which :meth:`velocity` uses the frozen reference (LoRA disabled, or the frozen copy).

        Raises:
            NotImplementedError: Full fine-tuning without ``reference=True``.
        """
        if self.lora is not None or self._ref_transformer is not None:
            return self._reference_ctx()
        if not self.full_finetune:
            return nullcontext()  # a frozen policy is its own reference
        raise NotImplementedError("FluxPolicy: full fine-tuning needs reference=True to keep a frozen reference copy")

    def train(self, mode: bool = True) -> None:
        """Train/eval mode of the transformer only (text encoders and VAE stay in eval: no dropout)."""
        self.transformer.train(mode)

    # ------------------------------------------------------------------------------------------------- LoRA

    def save_lora(self, directory: str | Path) -> Path:
        """Write the adapter as diffusers-loadable ``pytorch_lora_weights.safetensors`` in ``directory``.

        Load it with ``FluxPipeline.from_pretrained(...).load_lora_weights(directory)``.
        """
        from diffusers import FluxPipeline
        from peft.utils import get_peft_model_state_dict

        if self.lora is None:
            raise RuntimeError("FluxPolicy.save_lora: the policy has no LoRA adapter")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        layers = get_peft_model_state_dict(self.transformer)
        kwargs: dict[str, Any] = {}
        if "transformer_lora_adapter_metadata" in inspect.signature(FluxPipeline.save_lora_weights).parameters:
            # The LoRA config (alpha, rank, targets), so load_lora_weights restores alpha/rank instead of assuming 1.
            kwargs["transformer_lora_adapter_metadata"] = self.transformer.peft_config["default"].to_dict()
        FluxPipeline.save_lora_weights(str(directory), transformer_lora_layers=layers, **kwargs)
        return directory

    def state_dict(self) -> dict[str, Any]:
        """Trainable weights only (LoRA adapter state, or the full transformer), for checkpoints."""
        if self.lora is not None:
            from peft.utils import get_peft_model_state_dict

            return {"lora": {k: v.detach().cpu() for k, v in get_peft_model_state_dict(self.transformer).items()}}
        if self.full_finetune:
            return {"transformer": {k: v.detach().cpu() for k, v in self.transformer.state_dict().items()}}
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (after :meth:`setup`)."""
        if "lora" in state:
            from peft.utils import set_peft_model_state_dict

            set_peft_model_state_dict(self.transformer, state["lora"])
        if "transformer" in state:
            self.transformer.load_state_dict(state["transformer"])


def _quiet_hf_progress_bars() -> None:
    """Loading bars from diffusers/transformers would interleave with rlpost's own progress display."""
    import diffusers.utils.logging as dlog
    import transformers.utils.logging as tlog

    dlog.disable_progress_bar()
    tlog.disable_progress_bar()  # type: ignore[no-untyped-call]


@hookimpl
def rlpost_register_models(register: Registry[Policy]) -> None:
    """Register :class:`FluxPolicy` (short name ``flux``)."""
    register(FluxPolicy)
