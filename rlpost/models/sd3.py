"""Stable Diffusion 3 / 3.5 as an rlpost :class:`~rlpost.core.api.Policy`, on the real diffusers stack.

Everything SD3 specific lives here: loading ``StableDiffusion3Pipeline``, prompt encoding with its three text
encoders, the ``SD3Transformer2DModel`` call signature, the latent shape and the VAE scaling/shift. Samplers see only
``sigmas`` / ``initial_noise`` / ``encode`` / ``velocity`` / ``decode``; the FLUX adapter (``rlpost/models/flux.py``)
is another module of this shape (see ``docs/models.md``).

With the Euler ODE kernel and the default ``time_grid="diffusers"``, sampling through this adapter reproduces
``StableDiffusion3Pipeline.__call__`` exactly (same schedule, timestep ``1000·σ``, the pipeline's CFG formula and
``[negative, positive]`` batch order); the test suite checks this on a tiny model.
"""

from __future__ import annotations

import copy
import inspect
import math
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, ClassVar

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
    resolution_problems,
    resolve_dtype,
)
from rlpost.models.tiny import ensure_tiny_sd3, parse_tiny_id
from rlpost.ops.schedules import TIME_GRIDS, TimeGrid, clean_tail_steps, time_grid_sigmas, timesteps_from_sigmas

__all__ = ["LoraSpec", "SD3Policy", "rlpost_register_models"]

_SD3_REQUIRED = ("transformer", "vae", "scheduler", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
_SD3_WEIGHTED = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")


class SD3Policy(Policy):
    """Stable Diffusion 3/3.5 (MMDiT, rectified flow) loaded with ``StableDiffusion3Pipeline.from_pretrained``.

    Args:
        pretrained: Hub id (e.g. ``stabilityai/stable-diffusion-3.5-medium``, resolved from the local HF cache) or a
            local pipeline directory (with ``model_index.json`` and one subfolder per component).
        dtype: Weight dtype. ``auto`` = bfloat16 on CUDA, float32 on CPU. Means and log-probs are fp32 either way.
        resolution: Image height and width in pixels (a multiple of VAE factor × patch size).
        guidance_scale: Classifier-free guidance scale; ``> 1`` turns CFG on (doubling the transformer batch).
        negative_prompt: Prompt for the unconditional branch of CFG.
        lora: Train a LoRA adapter on the transformer with these settings; ``null`` for none.
        full_finetune: Train every transformer parameter instead of a LoRA adapter.
        gradient_checkpointing: Recompute transformer activations in the backward pass to save memory.
        reference: Keep a frozen reference model for KL terms. LoRA always has one for free (adapter disabled);
            full fine-tuning needs this flag and keeps a frozen copy of the transformer.
        max_sequence_length: T5 tokens per prompt (SD3 default 256; fewer is faster).
        local_files_only: Never contact the hub; hub ids must already be in the local cache.
        time_grid: Noise levels every sampler and the held-out evaluation step through (:meth:`sigmas`):
            ``"diffusers"`` (default; the pipeline's own ``FlowMatchEulerDiscreteScheduler`` grid, used by Flow-GRPO
            and TreeGRPO) or ``"shifted-linspace"`` (``time_shift(linspace(1, 0, T+1))``, used by DanceGRPO and
            MixGRPO). See ``docs/models.md`` "Time grids".
        shift: Static time shift of the grid; ``null`` takes the scheduler config's ``shift`` (SD3.5: 3.0).
    """

    name: ClassVar[str] = "sd3"

    def __init__(
        self,
        pretrained: str,
        dtype: DTypeName = "auto",
        resolution: int = 512,
        guidance_scale: float = 4.5,
        negative_prompt: str = "",
        lora: LoraSpec | None = None,
        full_finetune: bool = False,
        gradient_checkpointing: bool = False,
        reference: bool = False,
        max_sequence_length: int = 256,
        local_files_only: bool = True,
        time_grid: TimeGrid = "diffusers",
        shift: float | None = None,
    ) -> None:
        if lora is not None and full_finetune:
            raise ValueError("SD3Policy: choose either lora or full_finetune, not both")
        self.pretrained = pretrained
        self.dtype_name: DTypeName = dtype
        self.resolution = int(resolution)
        self.guidance_scale = float(guidance_scale)
        self.negative_prompt = negative_prompt
        self.lora = lora
        self.full_finetune = bool(full_finetune)
        self.gradient_checkpointing = bool(gradient_checkpointing)
        self.use_reference = bool(reference)
        self.max_sequence_length = int(max_sequence_length)
        self.local_files_only = bool(local_files_only)
        self.time_grid: TimeGrid = time_grid
        self.shift = None if shift is None else float(shift)
        self.forward_count: int = 0
        """Transformer evaluations in batch rows (before CFG doubling), summed over :meth:`velocity` calls."""
        self._pipe: Any = None  # StableDiffusion3Pipeline (untyped for mypy)
        self._device = torch.device("cpu")
        self._dtype = torch.float32
        self._ref_transformer: nn.Module | None = None
        self._use_ref = False
        self._cache = PromptCache()

    # ------------------------------------------------------------------------------------------------ set-up

    @property
    def do_cfg(self) -> bool:
        """Whether classifier-free guidance is on (``guidance_scale > 1``, the pipeline's rule)."""
        return self.guidance_scale > 1.0

    def clean_tail_steps(self) -> int | None:
        """Final steps of the recipe's grid that land on a (near-)clean level (:func:`clean_tail_steps`); ``None``
        for an unknown grid name (``validate`` reports that)."""
        return clean_tail_steps(self.time_grid) if self.time_grid in TIME_GRIDS else None

    def validate(self, recipe: Any) -> list[str]:
        """Check the settings, the model directory (local, or a hub id's snapshot in the local cache) and that the
        resolution fits the model's configs, without loading weights."""
        problems: list[str] = []
        if self.resolution <= 0:
            problems.append(f"model.init_args.resolution: must be positive, got {self.resolution}")
        if not math.isfinite(self.guidance_scale):
            problems.append(f"model.init_args.guidance_scale: must be a finite number, got {self.guidance_scale}")
        if self.max_sequence_length < 1:
            problems.append(f"model.init_args.max_sequence_length: must be >= 1, got {self.max_sequence_length}")
        if self.lora is not None:
            problems.extend(self.lora.problems("model.init_args.lora"))
        if self.time_grid not in TIME_GRIDS:
            problems.append(f"model.init_args.time_grid: must be one of {list(TIME_GRIDS)}, got {self.time_grid!r}")
        if self.shift is not None and not self.shift > 0:
            problems.append(f"model.init_args.shift: must be > 0 (or null for the scheduler's), got {self.shift}")
        try:
            tiny = parse_tiny_id(self.pretrained)
        except ValueError as e:
            return [*problems, f"model.init_args.pretrained: {e}"]
        if tiny is not None:
            return problems  # built on first use from known configs (rlpost/models/tiny.py)
        try:
            if is_local_path(self.pretrained):
                directory = Path(self.pretrained).expanduser()
            elif self.local_files_only:
                directory = cached_snapshot(self.pretrained)
            else:
                return problems  # may be downloaded by setup(); nothing local to check
            check_pipeline_dir(directory, _SD3_REQUIRED, _SD3_WEIGHTED)
        except ModelDirError as e:
            return [*problems, f"model.init_args.pretrained: {e}"]
        if self.resolution > 0:
            problems.extend(f"model.init_args.resolution: {p}" for p in resolution_problems(directory, self.resolution))
        return problems

    def setup(self, device: torch.device) -> None:
        """Load the pipeline, move it to ``device`` in the weight dtype and prepare LoRA / full FT / reference.

        Raises:
            ModelDirError: The local directory is missing or malformed (the message names what is missing).
            OSError: diffusers could not load the model (wrapped with the path or hub id).
        """
        from diffusers import StableDiffusion3Pipeline

        device = torch.device(device)
        self._device = device
        self._dtype = resolve_dtype(self.dtype_name, device)
        source = self.pretrained
        tiny = parse_tiny_id(source)
        if tiny is not None:
            # A random-weight SD3 of the real architecture, built once into the cache and then loaded through the
            # same from_pretrained path as SD3.5 (for CPU runs and tests; see rlpost/models/tiny.py).
            source = str(ensure_tiny_sd3(tiny))
        elif is_local_path(source):
            check_pipeline_dir(Path(source), _SD3_REQUIRED, _SD3_WEIGHTED)
            source = str(Path(source).expanduser())
        _quiet_hf_progress_bars()
        try:
            with warnings.catch_warnings():
                # diffusers >= 0.37 renamed torch_dtype to dtype; the old name still works across our range.
                warnings.filterwarnings("ignore", message=".*torch_dtype.*", category=FutureWarning)
                pipe: Any = StableDiffusion3Pipeline.from_pretrained(  # type: ignore[no-untyped-call]
                    source, torch_dtype=self._dtype, local_files_only=self.local_files_only
                )
        except Exception as e:  # diffusers raises OSError/ValueError/EnvironmentError with terse messages
            where = "local directory" if is_local_path(self.pretrained) else "hub id (local cache only)"
            raise OSError(f"SD3Policy: could not load {where} {self.pretrained!r}: {type(e).__name__}: {e}") from e
        if pipe.scheduler.config.get("use_dynamic_shifting", False):
            raise ValueError(f"{self.pretrained!r}: dynamic (resolution-dependent) time shifting is not supported")
        pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        for module in self._modules(pipe):
            module.eval()  # inference-mode encoders/VAE; train() below only toggles the transformer
            module.requires_grad_(False)
        factor = pipe.vae_scale_factor * pipe.transformer.config.patch_size
        if self.resolution % factor:
            raise ValueError(f"resolution {self.resolution} must be a multiple of {factor} (VAE factor x patch size)")
        transformer = pipe.transformer
        if self.lora is not None:
            transformer.add_adapter(self.lora.to_peft())
            for p in transformer.parameters():
                if p.requires_grad:
                    # Trainable adapter weights in fp32 even with bf16 weights (diffusers' cast_training_params).
                    p.data = p.data.float()
        elif self.full_finetune:
            if self.use_reference:
                self._ref_transformer = copy.deepcopy(transformer).requires_grad_(False).eval()
            transformer.requires_grad_(True)
        if self.gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
        self._pipe = pipe
        self._cache.clear()

    @staticmethod
    def _modules(pipe: Any) -> list[nn.Module]:
        names = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")
        return [m for m in (getattr(pipe, n, None) for n in names) if m is not None]

    @property
    def pipe(self) -> Any:
        """The loaded diffusers pipeline."""
        if self._pipe is None:
            raise RuntimeError("SD3Policy.setup(device) has not been called")
        return self._pipe

    @property
    def transformer(self) -> Any:
        """The (trainable) ``SD3Transformer2DModel``."""
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
        """``(C, H/f, W/f)`` of one latent."""
        f = self.pipe.vae_scale_factor
        return (self.transformer.config.in_channels, self.resolution // f, self.resolution // f)

    # ------------------------------------------------------------------------------------------------ policy

    def sigmas(self, num_steps: int) -> Tensor:
        """The recipe's time grid with the static shift (``shift``, else the scheduler config's).

        With ``time_grid="diffusers"`` this is exactly ``FlowMatchEulerDiscreteScheduler.sigmas`` (so the Euler ODE
        reproduces the pipeline); ``"shifted-linspace"`` is DanceGRPO's and MixGRPO's grid
        (:func:`rlpost.ops.schedules.time_grid_sigmas`).
        """
        cfg = self.pipe.scheduler.config
        shift = float(cfg.shift) if self.shift is None else self.shift
        return time_grid_sigmas(self.time_grid, num_steps, shift, int(cfg.num_train_timesteps)).to(self.device)

    def initial_noise(self, num: int, generator: torch.Generator) -> Tensor:
        """``[num, C, H/f, W/f]`` fp32 noise drawn on the generator's device (as diffusers' ``randn_tensor``)."""
        noise = torch.randn((num, *self.latent_shape), generator=generator, device=generator.device)
        return noise.to(self.device, torch.float32)

    def encode(self, prompts: Sequence[str]) -> Conditioning:
        """Encode prompts with the pipeline's ``encode_prompt`` (CLIP-L, CLIP-G, T5), cached per prompt string.

        ``Conditioning.tensors`` holds ``prompt_embeds`` ``[B, L, D]`` and ``pooled_prompt_embeds`` ``[B, P]``, plus
        ``negative_prompt_embeds`` / ``negative_pooled_prompt_embeds`` when CFG is on.
        """
        return Conditioning(self._cache.get(list(prompts), self._encode_batch))

    @torch.no_grad()
    def _encode_batch(self, prompts: list[str]) -> dict[str, Tensor]:
        pe, npe, pp, npp = self.pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=self.do_cfg,
            negative_prompt=[self.negative_prompt] * len(prompts) if self.do_cfg else None,
            max_sequence_length=self.max_sequence_length,
        )
        out = {"prompt_embeds": pe, "pooled_prompt_embeds": pp}
        if self.do_cfg:
            out |= {"negative_prompt_embeds": npe, "negative_pooled_prompt_embeds": npp}
        return out

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning) -> Tensor:
        """Velocity at ``(latents, σ)`` with CFG ``v_u + g·(v_c - v_u)`` (the pipeline's formula), in fp32.

        Args:
            latents: ``[B, C, h, w]`` states.
            sigma: ``[B]`` noise levels; the transformer gets ``timestep = 1000·σ``.
            cond: ``B`` rows of conditioning from :meth:`encode` (``Conditioning.select``).
        """
        b = latents.shape[0]
        t = cond.tensors
        if t["prompt_embeds"].shape[0] != b:
            raise ValueError(f"velocity: {b} latents but {t['prompt_embeds'].shape[0]} conditioning rows")
        sigma = sigma.to(self.device, torch.float32).reshape(-1).expand(b)
        x = latents.to(self.device, self._dtype)
        timestep = timesteps_from_sigmas(sigma)
        enc, pooled = t["prompt_embeds"], t["pooled_prompt_embeds"]
        if self.do_cfg:
            # Same batch layout as StableDiffusion3Pipeline: [uncond rows; cond rows].
            x = torch.cat([x, x])
            timestep = torch.cat([timestep, timestep])
            enc = torch.cat([t["negative_prompt_embeds"], enc])
            pooled = torch.cat([t["negative_pooled_prompt_embeds"], pooled])
        transformer = (
            self._ref_transformer if (self._use_ref and self._ref_transformer is not None) else self.transformer
        )
        out: Tensor = transformer(
            hidden_states=x,
            timestep=timestep,
            encoder_hidden_states=enc.to(self._dtype),
            pooled_projections=pooled.to(self._dtype),
            return_dict=False,
        )[0]
        self.forward_count += b
        if self.do_cfg:
            uncond, text = out.chunk(2)
            if self._dtype != torch.float32:
                uncond, text = uncond.float(), text.float()
            out = uncond + self.guidance_scale * (text - uncond)
        return out.float()

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """VAE-decode clean latents (``x / scaling_factor + shift_factor``) to ``[B, H, W, 3]`` uint8 on the device."""
        vae = self.pipe.vae
        x = latents.to(self.device, torch.float32) / vae.config.scaling_factor + vae.config.shift_factor
        img: Tensor = vae.decode(x.to(vae.dtype), return_dict=False)[0].float()
        # diffusers VaeImageProcessor.postprocess: [-1, 1] -> [0, 1], then numpy_to_pil's round(x*255).
        img = (img / 2 + 0.5).clamp(0, 1)
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
        raise NotImplementedError("SD3Policy: full fine-tuning needs reference=True to keep a frozen reference copy")

    def train(self, mode: bool = True) -> None:
        """Train/eval mode of the transformer only (text encoders and VAE stay in eval: no dropout)."""
        self.transformer.train(mode)

    # ------------------------------------------------------------------------------------------------- LoRA

    def save_lora(self, directory: str | Path) -> Path:
        """Write the adapter as diffusers-loadable ``pytorch_lora_weights.safetensors`` in ``directory``.

        Load it with ``StableDiffusion3Pipeline.from_pretrained(...).load_lora_weights(directory)``.
        """
        from diffusers import StableDiffusion3Pipeline
        from peft.utils import get_peft_model_state_dict

        if self.lora is None:
            raise RuntimeError("SD3Policy.save_lora: the policy has no LoRA adapter")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        layers = get_peft_model_state_dict(self.transformer)
        kwargs: dict[str, Any] = {}
        if (
            "transformer_lora_adapter_metadata"
            in inspect.signature(StableDiffusion3Pipeline.save_lora_weights).parameters
        ):
            # Store the LoRA config (alpha, rank, targets) so load_lora_weights restores the alpha/rank scaling;
            # without it diffusers assumes alpha == rank.
            kwargs["transformer_lora_adapter_metadata"] = self.transformer.peft_config["default"].to_dict()
        StableDiffusion3Pipeline.save_lora_weights(str(directory), transformer_lora_layers=layers, **kwargs)
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
    """Register :class:`SD3Policy` (short name ``sd3``)."""
    register(SD3Policy)
