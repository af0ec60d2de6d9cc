"""The base of diffusers-backed policy adapters (SD3, FLUX.1; docs/models.md "Adding a model family").

:class:`DiffusersTransformerPolicy` is the base of adapters whose trainable part is one diffusers transformer:
loading, freezing, LoRA / full fine-tuning, the frozen reference, VAE decoding and checkpoint state are the same for
every such family, so an adapter writes only what is its own (prompt encoding, the transformer call, the latent
layout and the time grid); :class:`PromptCache` caches its prompt encodings. The settings they share (dtype policy,
LoRA spec) are :mod:`rlpost.models.adapter_settings`; model-directory checks with clear errors are
:mod:`rlpost.models.pipeline_dir`.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from abc import abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from rlpost.core.api import HubFiles, InvalidArguments, Policy, resolve_guidance
from rlpost.models.acceleration import AccelerateConfig, Speedups
from rlpost.models.adapter_settings import DTypeName, LoraSpec, resolve_dtype
from rlpost.models.pipeline_dir import (
    PipelineFamilyError,
    cached_snapshot,
    check_pipeline_dir,
    is_local_path,
    quiet_hf_progress_bars,
)
from rlpost.models.tiny import parse_tiny_id
from rlpost.ops.schedules import TIME_GRIDS, TimeGrid

__all__ = ["DiffusersTransformerPolicy", "PromptCache"]


def _unreadable_safetensors(directory: Path) -> list[str]:
    """The ``<component>/*.safetensors`` files of a pipeline directory whose header does not read (truncated, empty
    or not safetensors at all): what a failed ``from_pretrained`` tripped on, named for the error message."""
    from safetensors import safe_open

    bad = []
    for f in sorted(directory.glob("*/*.safetensors")) if directory.is_dir() else []:
        try:
            with safe_open(str(f), framework="pt"):
                pass
        except Exception:  # noqa: BLE001 - SafetensorError (not an OSError subclass) or OSError
            bad.append(str(f))
    return bad


class PromptCache:
    """Per-prompt-string cache of encoder outputs: each prompt is encoded once per process.

    ``encode_new(prompts)`` is called with the prompts not yet cached (in first-seen order) and returns a dict of
    ``[len(prompts), ...]`` tensors; rows are stored per prompt and reassembled in request order.
    """

    def __init__(self) -> None:
        self._rows: dict[str, dict[str, Tensor]] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def clear(self) -> None:
        """Drop every cached encoding (e.g. after the text encoders change)."""
        self._rows.clear()

    def get(self, prompts: Sequence[str], encode_new: Callable[[list[str]], dict[str, Tensor]]) -> dict[str, Tensor]:
        """Return stacked encodings of ``prompts``, encoding the missing ones in one batch."""
        missing = list(dict.fromkeys(p for p in prompts if p not in self._rows))
        if missing:
            out = encode_new(missing)
            for i, p in enumerate(missing):
                self._rows[p] = {k: v[i : i + 1].detach() for k, v in out.items()}
        if not prompts:
            raise ValueError("encode() needs at least one prompt")
        keys = self._rows[prompts[0]].keys()
        return {k: torch.cat([self._rows[p][k] for p in prompts], dim=0) for k in keys}


class DiffusersTransformerPolicy(Policy):
    """A :class:`~rlpost.core.api.Policy` over a diffusers pipeline whose one trainable module is ``pipe.transformer``.

    Subclasses (``SD3Policy``, ``FluxPolicy``) set the class attributes below and implement :meth:`_build_tiny`,
    :meth:`setup` (calling :meth:`_load_pipeline` then :meth:`_prepare`), ``sigmas``, ``encode`` and ``velocity``
    (taking the denoiser from :meth:`_active_transformer` so :meth:`reference` works). The constructor arguments are
    documented on each subclass.
    """

    pipeline_class: ClassVar[str] = ""
    """Name of the diffusers pipeline class (``diffusers.<name>``) loaded with ``from_pretrained``."""
    required_components: ClassVar[tuple[str, ...]] = ()
    """``model_index.json`` entries a local pipeline directory must have (:func:`check_pipeline_dir`)."""
    weighted_components: ClassVar[tuple[str, ...]] = ()
    """Components that must hold a config and weights; also the modules frozen in eval mode after loading."""
    gated_repos: ClassVar[frozenset[str]] = frozenset()
    """Hub ids of this family whose licence must be accepted before downloading (``rlpost download`` says how)."""

    def __init__(
        self,
        pretrained: str,
        dtype: DTypeName,
        resolution: int,
        guidance_scale: float,
        lora: LoraSpec | None,
        full_finetune: bool,
        gradient_checkpointing: bool,
        reference: bool,
        max_sequence_length: int,
        local_files_only: bool,
        time_grid: TimeGrid,
        shift: float | None,
    ) -> None:
        if lora is not None and full_finetune:
            problem = "true together with lora: choose either lora or full_finetune, not both"
            raise InvalidArguments(type(self).__name__, {"full_finetune": problem})
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
        """Transformer evaluations in batch rows (before any CFG doubling), summed over ``velocity`` calls."""
        self._pipe: Any = None  # the diffusers pipeline (untyped for mypy)
        self._device = torch.device("cpu")
        self._dtype = torch.float32
        self._ref_transformer: nn.Module | None = None
        self._use_ref = False
        self._cache = PromptCache()
        self._speedups: Speedups | None = None

    # ------------------------------------------------------------------------------------------------ set-up

    @abstractmethod
    def _build_tiny(self, seed: int) -> Path:
        """Build (once, into the cache) the tiny random-weight pipeline for ``tiny-random[:SEED]`` and return its
        directory (see ``rlpost/models/tiny.py``)."""

    def _setting_problems(self) -> list[str]:
        """Problems of the settings every family shares that are no argument range (the ranges of ``resolution``,
        ``max_sequence_length``, ``shift`` and the guidance scale are declared on each adapter's constructor), each
        naming its recipe field."""
        problems: list[str] = []
        if self.lora is not None:
            problems.extend(self.lora.problems("model.init_args.lora"))
        if self.time_grid not in TIME_GRIDS:
            problems.append(f"model.init_args.time_grid: must be one of {list(TIME_GRIDS)}, got {self.time_grid!r}")
        return problems

    def hub_files(self) -> list[HubFiles]:
        """The pipeline's ``model_index.json`` and the folders of its required and weighted components (each text
        encoder with its tokenizer) when ``pretrained`` is a Hub id (a local directory or a ``tiny-random`` id needs
        nothing): what ``from_pretrained`` reads, without a repository's other files (single-file checkpoints)."""
        if parse_tiny_id(self.pretrained) is not None or is_local_path(self.pretrained):
            return []
        components = list(dict.fromkeys((*self.required_components, *self.weighted_components)))
        tokenizers = [c.replace("text_encoder", "tokenizer") for c in components if c.startswith("text_encoder")]
        patterns = ("model_index.json", *(f"{c}/*" for c in dict.fromkeys(components + tokenizers)))
        gated = self.pretrained in self.gated_repos
        return [HubFiles(self.pretrained, patterns, gated=gated, purpose=f"base model of {type(self).__name__}")]

    def _pretrained_dir(self) -> Path | None:
        """The checked local pipeline directory ``validate`` can read configs from, without loading weights.

        Returns:
            The directory (local, or a hub id's snapshot in the local cache); ``None`` for a ``tiny-random`` id
            (built on first use from known configs) or a hub id ``setup`` may still download.

        Raises:
            ValueError: A malformed ``tiny-random`` id.
            ModelDirError: The directory is missing or malformed (the message names what is missing), or holds a
                pipeline of another family (naming the adapters that load it).
        """
        if parse_tiny_id(self.pretrained) is not None:
            return None
        if is_local_path(self.pretrained):
            directory = Path(self.pretrained).expanduser()
        elif self.local_files_only:
            files = self.hub_files()[0]
            directory = cached_snapshot(self.pretrained, files.command(), files.access_hint())
        else:
            return None
        self._check_dir(directory)
        return directory

    def _check_dir(self, directory: Path) -> None:
        """:func:`check_pipeline_dir` for this adapter; a directory of another pipeline family is refused with the
        adapters (among the loaded ones) that take it."""
        try:
            check_pipeline_dir(directory, self.required_components, self.weighted_components, self.pipeline_class)
        except PipelineFamilyError as e:
            adapters = _adapters_of(e.found)
            hint = f"use model class_path {' or '.join(adapters)}" if adapters else "no loaded model adapter takes it"
            raise PipelineFamilyError(f"{e}; {hint}", e.found, e.expected) from None

    def _load_pipeline(self, device: torch.device) -> Any:
        """Set the device and weight dtype and load the pipeline (not yet moved to ``device``).

        Raises:
            ModelDirError: The local directory is missing or malformed (the message names what is missing).
            OSError: diffusers could not load the model (wrapped with the path or hub id).
        """
        import diffusers

        device = torch.device(device)
        self._device = device
        self._dtype = resolve_dtype(self.dtype_name, device)
        source = self.pretrained
        tiny = parse_tiny_id(source)
        if tiny is not None:
            # A random-weight model of the real architecture, built once into the cache and then loaded through the
            # same from_pretrained path as the released weights (for CPU runs and tests).
            source = str(self._build_tiny(tiny))
        elif is_local_path(source):
            self._check_dir(Path(source).expanduser())
            source = str(Path(source).expanduser())
        quiet_hf_progress_bars()
        try:
            with warnings.catch_warnings():
                # diffusers >= 0.37 renamed torch_dtype to dtype; the old name still works across our range.
                warnings.filterwarnings("ignore", message=".*torch_dtype.*", category=FutureWarning)
                return getattr(diffusers, self.pipeline_class).from_pretrained(
                    source, torch_dtype=self._dtype, local_files_only=self.local_files_only
                )
        except Exception as e:  # diffusers raises OSError/ValueError/EnvironmentError with terse messages
            where = "local directory" if is_local_path(self.pretrained) else "hub id (local cache only)"
            bad = _unreadable_safetensors(Path(source))  # transformers' SafetensorError names no file
            named = f" (not readable safetensors: {', '.join(bad)})" if bad else ""
            raise OSError(
                f"{type(self).__name__}: could not load {where} {self.pretrained!r}: {type(e).__name__}: {e}{named}"
            ) from e

    def _prepare(self, pipe: Any, factor: int, factor_meaning: str) -> None:
        """Move ``pipe`` to the device, freeze everything but the transformer, check that the resolution is a multiple
        of ``factor`` (``factor_meaning`` says why), and set up LoRA / full fine-tuning / the frozen reference."""
        pipe.to(self._device)
        pipe.set_progress_bar_config(disable=True)
        for name in ("transformer", *self.weighted_components):
            module = getattr(pipe, name, None)
            if module is not None:
                module.eval()  # inference-mode encoders/VAE; train() below only toggles the transformer
                module.requires_grad_(False)
        if self.resolution % factor:
            raise ValueError(f"resolution {self.resolution} must be a multiple of {factor} ({factor_meaning})")
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
        self._speedups = None

    def accelerate(self, settings: AccelerateConfig) -> None:
        """Apply ``run.speedups`` after :meth:`setup` (:mod:`rlpost.models.acceleration`): attention backend,
        channels-last VAE and in-place ``torch.compile`` of ``pipe.transformer``; every later transformer call of
        ``velocity`` runs under the call's speed-ups (compiled or eager, autocast) by its gradient mode.

        Raises:
            ValueError: A speed-up this model cannot apply (naming its ``run.speedups`` field).
        """
        speedups = Speedups(settings, self.device)
        speedups.apply(self.transformer, getattr(self.pipe, "vae", None))
        self._speedups = speedups

    def clear_prompt_cache(self) -> None:
        """Forget every cached prompt encoding (the next ``encode`` encodes afresh)."""
        self._cache.clear()

    def without_speedups(self) -> AbstractContextManager[None]:
        """Transformer calls as without ``run.speedups`` while open (:meth:`Speedups.bypassed`; a no-op when
        :meth:`accelerate` was not called)."""
        return nullcontext() if self._speedups is None else self._speedups.bypassed()

    @property
    def pipe(self) -> Any:
        """The loaded diffusers pipeline."""
        if self._pipe is None:
            raise RuntimeError(f"{type(self).__name__}.setup(device) has not been called")
        return self._pipe

    @property
    def transformer(self) -> Any:
        """The (trainable) diffusers transformer, ``pipe.transformer``."""
        return self.pipe.transformer

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def weight_dtype(self) -> torch.dtype:
        """dtype of the loaded weights."""
        return self._dtype

    @property
    @abstractmethod
    def latent_shape(self) -> tuple[int, int, int]:
        """``(C, H/f, W/f)`` of one image-shaped latent."""

    # ------------------------------------------------------------------------------------------------ policy

    def initial_noise(self, num: int, generator: torch.Generator) -> Tensor:
        """``[num, C, H/f, W/f]`` fp32 noise drawn on the generator's device in the image-shaped latent layout, as the
        pipelines' ``prepare_latents`` (diffusers ``randn_tensor``) do, so the same generator gives their noise."""
        noise = torch.randn((num, *self.latent_shape), generator=generator, device=generator.device)
        return noise.to(self.device, torch.float32)

    def _cfg_scale(self, guidance: float | None, setting: str = "model.init_args.guidance_scale") -> float:
        """The classifier-free guidance scale of one ``velocity`` call (:func:`~rlpost.core.api.resolve_guidance`):
        the configured scale for ``None``; a scale above 1 only when ``encode`` computed the negative rows (the
        configured scale is above 1, the pipelines' rule). CFG runs when the result is above 1."""
        return resolve_guidance(guidance, self.guidance_scale, can_guide=self.guidance_scale > 1.0, setting=setting)

    def _active_transformer(self) -> Any:
        """The denoiser ``velocity`` calls: the frozen copy inside :meth:`reference` under full fine-tuning; with
        ``run.speedups`` on, a stand-in calling it under the speed-ups (its attributes are the module's)."""
        module = self._ref_transformer if (self._use_ref and self._ref_transformer is not None) else self.transformer
        return module if self._speedups is None else self._speedups.wrap(module)

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """VAE-decode clean latents (``x / scaling_factor + shift_factor``) to ``[B, 1, H, W, 3]`` uint8 on the device
        (one-frame media)."""
        vae = self.pipe.vae
        x = latents.to(self.device, torch.float32) / vae.config.scaling_factor + vae.config.shift_factor
        img: Tensor = vae.decode(x.to(vae.dtype), return_dict=False)[0].float()
        # diffusers VaeImageProcessor.postprocess: [-1, 1] -> [0, 1], then numpy_to_pil's round(x*255).
        img = (img / 2 + 0.5).clamp(0, 1)
        return (img * 255).round().to(torch.uint8).permute(0, 2, 3, 1).unsqueeze(1).contiguous()

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
        """Context in which ``velocity`` uses the frozen reference (LoRA disabled, or the frozen copy).

        Raises:
            NotImplementedError: Full fine-tuning without ``reference=True``.
        """
        if self.lora is not None or self._ref_transformer is not None:
            return self._reference_ctx()
        if not self.full_finetune:
            return nullcontext()  # a frozen policy is its own reference
        raise NotImplementedError(
            f"{type(self).__name__}: full fine-tuning needs reference=True to keep a frozen reference copy"
        )

    def train(self, mode: bool = True) -> None:
        """Train/eval mode of the transformer only (text encoders and VAE stay in eval: no dropout)."""
        self.transformer.train(mode)

    # ------------------------------------------------------------------------------------------------- LoRA

    def save_lora(self, directory: str | Path) -> Path:
        """Write the adapter as diffusers-loadable ``pytorch_lora_weights.safetensors`` in ``directory``.

        Load it with ``<pipeline_class>.from_pretrained(...).load_lora_weights(directory)``.
        """
        import diffusers
        from peft.utils import get_peft_model_state_dict

        if self.lora is None:
            raise RuntimeError(f"{type(self).__name__}.save_lora: the policy has no LoRA adapter")
        pipeline_cls: Any = getattr(diffusers, self.pipeline_class)
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        layers = get_peft_model_state_dict(self.transformer)
        kwargs: dict[str, Any] = {}
        if "transformer_lora_adapter_metadata" in inspect.signature(pipeline_cls.save_lora_weights).parameters:
            # Store the LoRA config (alpha, rank, targets) so load_lora_weights restores the alpha/rank scaling;
            # without it diffusers assumes alpha == rank.
            kwargs["transformer_lora_adapter_metadata"] = self.transformer.peft_config["default"].to_dict()
        pipeline_cls.save_lora_weights(str(directory), transformer_lora_layers=layers, **kwargs)
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
        """Restore what :meth:`state_dict` returned (after ``setup``)."""
        if "lora" in state:
            from peft.utils import set_peft_model_state_dict

            set_peft_model_state_dict(self.transformer, state["lora"])
        if "transformer" in state:
            self.transformer.load_state_dict(state["transformer"])


def _adapters_of(pipeline_class: str) -> list[str]:
    """The recipe names of the adapters defined so far (the imported model families) that load ``pipeline_class``."""
    names: set[str] = set()
    todo = DiffusersTransformerPolicy.__subclasses__()
    while todo:
        adapter = todo.pop()
        todo.extend(adapter.__subclasses__())
        if adapter.pipeline_class == pipeline_class and adapter.name:
            names.add(adapter.name)
    return sorted(names)
