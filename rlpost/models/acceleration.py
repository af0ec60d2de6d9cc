"""Opt-in speed-ups of a diffusers transformer policy: the ``run.speedups`` settings (:class:`AccelerateConfig`) and
how they are applied (:class:`Speedups`; docs/speed.md says what each one changes numerically).

Every speed-up is off by default. What each does, and where it hooks in:

* ``compile``: ``torch.compile`` of the transformer, in place (``nn.Module.compile``: same module, same parameter
  names, so LoRA, checkpoints and ``save_lora`` are unchanged), either its repeated blocks (``compile_regional``,
  diffusers' regional compilation, ``ModelMixin.compile_repeated_blocks`` in diffusers 0.42
  ``models/modeling_utils.py``) or the whole model. ``rollout`` compiles the forwards without gradients (rollouts,
  held-out evaluation, a KL term's reference forwards), ``train`` the forwards with gradients (the update), ``both``
  both; the path that is not compiled runs under ``torch.compiler.set_stance("force_eager")``.
* ``cuda_graphs``: torch.compile's ``reduce-overhead`` mode (CUDA graph trees: one graph per input shape, so it pays
  where shapes repeat; outputs are cloned out of the graph's memory pool before the next replay).
* ``attention_backend``: a diffusers attention backend (``diffusers.models.attention_dispatch.AttentionBackendName``),
  set with ``ModelMixin.set_attention_backend`` on models whose attention processors dispatch through diffusers
  (FLUX.1, Wan, Qwen-Image). SD3's ``JointAttnProcessor2_0`` calls ``torch.nn.functional.scaled_dot_product_attention``
  itself, so there the ``native`` family is mapped onto ``torch.nn.attention.sdpa_kernel`` (as diffusers'
  ``_native_*`` backends do internally) and other backends are refused. It applies to both paths.
* ``vae_channels_last``: the VAE's convolution weights in channels-last layout (``channels_last_3d`` for 3-D
  convolutions), so convolutions run in NHWC; decoding only, never the ratio.
* ``autocast``: ``torch.autocast`` of the transformer forward to bf16 (or fp16, rollout only: the update does no loss
  scaling) on ``autocast_scope``; kernel means and log-probs stay fp32/fp64 (``rlpost.ops.kernels``).

The policy wraps each transformer call in :meth:`Speedups.call` (rlpost/models/_common.py), which picks the path by
``torch.is_grad_enabled()``. Before training a guard checks that the speed-ups leave what the update rule sees
unchanged (``rlpost.engine.ratio_guard``): for a policy-gradient rule it re-evaluates a rollout through the training
path and refuses the run when ``max |ratio - 1| > ratio_tolerance``; for a likelihood-free rule it computes one
batch's loss with the speed-ups and without them (:meth:`Speedups.bypassed`, reached through
:meth:`Accelerable.without_speedups`) and refuses when the relative difference exceeds ``loss_tolerance``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Literal, Protocol, get_args, runtime_checkable

import torch
from torch import nn

__all__ = [
    "CPU_ATTENTION_BACKENDS",
    "AccelerateConfig",
    "Accelerable",
    "Speedups",
    "acceleration_problems",
    "apply_acceleration",
    "attention_backend_names",
    "repeated_blocks",
]

CompileScope = Literal["off", "rollout", "train", "both"]
PathScope = Literal["both", "rollout", "train"]
AutocastName = Literal["off", "bfloat16", "float16"]
CompileMode = Literal["default", "max-autotune-no-cudagraphs"]

CPU_ATTENTION_BACKENDS = ("native", "_native_math", "_native_flash")
"""Attention backends that run on a CPU (torch's SDPA math and CPU flash kernels)."""

_SDPA_BACKENDS = {
    "native": None,  # torch picks the kernel, as without the setting
    "_native_math": "MATH",
    "_native_flash": "FLASH_ATTENTION",
    "_native_efficient": "EFFICIENT_ATTENTION",
    "_native_cudnn": "CUDNN_ATTENTION",
}
"""The diffusers ``native`` backends as ``torch.nn.attention.SDPBackend`` names (for processors that call SDPA)."""

_AUTOCAST = {"bfloat16": torch.bfloat16, "float16": torch.float16}
_DYNAMO_RECOMPILE_LIMIT = 64
"""Raised from torch's 8: one compiled block code serves blocks of several shapes (SD3's dual-attention and last
blocks), both gradient modes, LoRA on and off (reference forwards) and the batch sizes a tree's frontier takes; past
the limit dynamo silently runs a block eagerly."""


def attention_backend_names() -> list[str]:
    """Every backend name diffusers knows (``AttentionBackendName`` values)."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    return [b.value for b in AttentionBackendName]


def _device_type(spec: str) -> str | None:
    """``run.device`` as a device type (``auto``: CUDA when available); ``None`` when it names no device (the run
    section reports that)."""
    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return torch.device(spec).type
    except RuntimeError:
        return None


@dataclass
class AccelerateConfig:
    """``run.speedups``: opt-in speed-ups, each documented with what it changes numerically in docs/speed.md.

    Attributes:
        compile: ``torch.compile`` of the transformer for the ``rollout`` (no-grad forwards: rollouts, evaluation,
            reference forwards), for ``train`` (forwards with gradients), ``both``, or ``off``.
        compile_mode: torch.compile's ``mode`` (``default``, or ``max-autotune-no-cudagraphs``: autotuned kernels,
            long compile).
        compile_regional: Compile each repeated transformer block (diffusers' regional compilation: one compiled
            code for all blocks, short compile) instead of the whole model.
        cuda_graphs: CUDA graphs through torch.compile (``reduce-overhead``, or ``max-autotune`` with that mode);
            needs ``compile`` and a CUDA device.
        attention_backend: A diffusers attention backend name (``native``, ``_native_flash``, ``flash``, ``sage``,
            ...; ``null`` leaves the model's own). On a CPU only ``native``, ``_native_math`` and ``_native_flash``.
        vae_channels_last: VAE convolutions in channels-last layout (decoding only).
        autocast: ``bfloat16`` or ``float16`` autocast of the transformer forward, or ``off``.
        autocast_scope: Where autocast applies: ``both`` paths, ``rollout`` or ``train`` only. One path only changes
            the importance ratio (the guard decides whether within tolerance); ``float16`` is refused in training.
        ratio_tolerance: The ratio guard refuses the run when a rollout re-evaluated by the training path has
            ``max |ratio - 1|`` above this (checked before training whenever a speed-up is on and the update rule
            requires ``edge-log-probs``).
        loss_tolerance: The loss guard refuses the run when one batch's loss with the speed-ups differs from the
            loss without them by more than this, relatively (checked before training whenever a speed-up is on and
            the update rule is likelihood-free, i.e. does not require ``edge-log-probs``).
        guard_groups: Prompt groups of the guard's rollout (drawn from a copy of the prompt stream with a generator
            of its own, so the run's results do not depend on it).
        overlap_groups: Sample a step in parts of this many prompt groups and score each finished part (decoded
            samples, every reward) in a worker thread while the next part samples (:mod:`rlpost.engine.overlap`);
            0 (the default) samples the step at once. It changes no ratio, but the rollout then draws from
            per-group noise streams (those of ``distributed``): the run equals a one-rank ``distributed`` run, with
            or without overlap (same rewards and advantages up to batch effects), not the default stream's draws.
    """

    compile: CompileScope = "off"
    compile_mode: CompileMode = "default"
    compile_regional: bool = True
    cuda_graphs: bool = False
    attention_backend: str | None = None
    vae_channels_last: bool = False
    autocast: AutocastName = "off"
    autocast_scope: PathScope = "both"
    ratio_tolerance: float = 1e-3
    loss_tolerance: float = 1e-3
    guard_groups: int = 1
    overlap_groups: int = 0

    def enabled(self) -> list[str]:
        """The speed-ups that are on, one label each (empty: none; the guard and :class:`Speedups` stay idle)."""
        out = []
        if self.compile != "off":
            how = "regional" if self.compile_regional else "whole model"
            out.append(f"compile={self.compile} ({how}, mode {self.compile_mode})")
        if self.cuda_graphs:
            out.append("cuda_graphs")
        if self.attention_backend is not None:
            out.append(f"attention_backend={self.attention_backend}")
        if self.vae_channels_last:
            out.append("vae_channels_last")
        if self.autocast != "off":
            out.append(f"autocast={self.autocast} ({self.autocast_scope})")
        return out

    def labels(self) -> list[str]:
        """Every setting that is on, for reports: :meth:`enabled` plus ``overlap_groups``, which changes no ratio
        (so the guard does not run for it) but does change the step's time."""
        return self.enabled() + ([f"overlap_groups={self.overlap_groups}"] if self.overlap_groups else [])

    def problems(self, device: str = "auto") -> list[str]:
        """Range problems, each naming its field relative to ``run`` (``speedups.<field>``), for ``run.device``
        ``device``: CUDA-only speed-ups are refused on a CPU run."""
        p = "speedups."
        problems: list[str] = []
        kind = _device_type(device)
        for name, allowed in (
            ("compile", get_args(CompileScope)),
            ("compile_mode", get_args(CompileMode)),
            ("autocast", get_args(AutocastName)),
            ("autocast_scope", get_args(PathScope)),
        ):
            if getattr(self, name) not in allowed:
                problems.append(f"{p}{name}: must be one of {list(allowed)}, got {getattr(self, name)!r}")
        if self.cuda_graphs and self.compile == "off":
            problems.append(f"{p}cuda_graphs: CUDA graphs are captured by torch.compile; set {p}compile as well")
        if self.cuda_graphs and kind not in (None, "cuda"):
            problems.append(f"{p}cuda_graphs: CUDA graphs need a CUDA device; run.device is {device!r}")
        problems += self._attention_problems(kind)
        if self.autocast == "float16" and self.autocast_scope != "rollout":
            problems.append(
                f"{p}autocast: float16 in the training path needs loss scaling, which the update does not do; use "
                f"bfloat16, or autocast_scope: rollout"
            )
        if not (math.isfinite(self.ratio_tolerance) and self.ratio_tolerance > 0):
            problems.append(f"{p}ratio_tolerance: must be a positive finite number, got {self.ratio_tolerance}")
        if not (math.isfinite(self.loss_tolerance) and self.loss_tolerance > 0):
            problems.append(f"{p}loss_tolerance: must be a positive finite number, got {self.loss_tolerance}")
        if isinstance(self.guard_groups, bool) or self.guard_groups < 1:
            problems.append(f"{p}guard_groups: must be >= 1, got {self.guard_groups}")
        if isinstance(self.overlap_groups, bool) or self.overlap_groups < 0:
            problems.append(f"{p}overlap_groups: must be >= 0 (0: no overlap), got {self.overlap_groups}")
        return problems

    def _attention_problems(self, kind: str | None) -> list[str]:
        name = self.attention_backend
        if name is None:
            return []
        field = "speedups.attention_backend"
        names = attention_backend_names()
        if name not in names:
            return [f"{field}: unknown backend {name!r}; diffusers knows {sorted(names)}"]
        if name.endswith("_hub"):
            return [f"{field}: {name!r} downloads its kernel from the Hugging Face Hub; rlpost downloads nothing"]
        if kind == "cpu" and name not in CPU_ATTENTION_BACKENDS:
            return [f"{field}: {name!r} needs a GPU; on a CPU use one of {list(CPU_ATTENTION_BACKENDS)}"]
        return []


@runtime_checkable
class Accelerable(Protocol):
    """A policy that can apply ``run.speedups`` (every :class:`~rlpost.models.DiffusersTransformerPolicy`)."""

    def accelerate(self, settings: AccelerateConfig) -> None:
        """Apply the speed-ups after ``setup``."""

    def clear_prompt_cache(self) -> None:
        """Forget cached prompt encodings (the ratio guard leaves the cache as it found it)."""

    def without_speedups(self) -> AbstractContextManager[None]:
        """Run every transformer call as without ``run.speedups`` while the context is open
        (:meth:`Speedups.bypassed`; nothing changes when no speed-up was applied): the loss guard's reference."""


def acceleration_problems(settings: AccelerateConfig, model: object) -> list[str]:
    """``run.speedups`` asks for speed-ups the model cannot apply (a policy without :class:`Accelerable`)."""
    if settings.enabled() and not isinstance(model, Accelerable):
        name = getattr(model, "name", type(model).__name__)
        return [f"run.speedups: model {name!r} ({type(model).__name__}) does not support speed-ups; turn them off"]
    return []


def apply_acceleration(model: object, settings: AccelerateConfig) -> None:
    """Apply ``settings`` to a set-up model (nothing when every speed-up is off).

    Raises:
        ValueError: The model cannot apply them (validation reports this before a run starts).
    """
    if not settings.enabled():
        return
    problems = acceleration_problems(settings, model)
    if problems:
        raise ValueError(problems[0])
    assert isinstance(model, Accelerable)
    model.accelerate(settings)


def repeated_blocks(transformer: nn.Module) -> list[nn.Module]:
    """The transformer's repeated blocks: the classes its ``_repeated_blocks`` names (diffusers' regional compilation
    list; FLUX.1, Wan, Qwen-Image), else the members of its top-level ``nn.ModuleList`` children (SD3's
    ``transformer_blocks``, which diffusers 0.42 does not list)."""
    names = set(getattr(transformer, "_repeated_blocks", None) or ())
    if names:
        return [m for m in transformer.modules() if type(m).__name__ in names]
    return [block for child in transformer.children() if isinstance(child, nn.ModuleList) for block in child]


def _channels_last(vae: nn.Module) -> None:
    """Convolution weights of ``vae`` in channels-last layout (2-D) or channels-last-3d (3-D); PyTorch's
    convolutions then run (and return) channels-last whatever the input's layout."""
    for module in vae.modules():
        if isinstance(module, (nn.Conv2d, nn.ConvTranspose2d)):
            fmt = torch.channels_last
        elif isinstance(module, (nn.Conv3d, nn.ConvTranspose3d)):
            fmt = torch.channels_last_3d
        else:
            continue
        module.weight.data = module.weight.data.contiguous(memory_format=fmt)


class Speedups:
    """``run.speedups`` applied to one policy: set up once by :meth:`apply`, then every transformer call goes
    through :meth:`call`.

    Args:
        settings: The run's speed-ups.
        device: The policy's device (autocast's device type).
    """

    def __init__(self, settings: AccelerateConfig, device: torch.device) -> None:
        self.settings = settings
        self.device = torch.device(device)
        self._sdpa: list[Any] | None = None  # SDPBackend list for processors that call torch SDPA themselves
        self._bypass = 0  # depth of open bypassed() contexts
        self.compiled_modules = 0
        """How many modules were compiled in place (blocks, or 1 for the whole model)."""

    # ------------------------------------------------------------------------------------------------ set-up

    def apply(self, transformer: nn.Module, vae: nn.Module | None) -> None:
        """Attention backend, channels-last VAE and in-place compilation (in that order: the compiled code reads the
        processors' backend).

        Raises:
            ValueError: The backend cannot serve this model's attention processors, or its package is missing
                (naming ``run.speedups.attention_backend``).
        """
        s = self.settings
        if s.attention_backend is not None:
            self._set_attention_backend(transformer, s.attention_backend)
        if s.vae_channels_last and vae is not None:
            _channels_last(vae)
        if s.compile != "off":
            self._compile(transformer)

    def _set_attention_backend(self, transformer: nn.Module, name: str) -> None:
        field = "run.speedups.attention_backend"
        processors = list(getattr(transformer, "attn_processors", {}).values())
        dispatching = [p for p in processors if hasattr(p, "_attention_backend")]
        if dispatching:
            try:
                transformer.set_attention_backend(name)  # type: ignore[operator]  # diffusers ModelMixin
            except (RuntimeError, ValueError) as exc:
                raise ValueError(f"{field}: {exc}") from exc
        if len(dispatching) < len(processors):  # processors calling torch SDPA themselves (SD3's JointAttnProcessor)
            if name not in _SDPA_BACKENDS:
                kinds = sorted({type(p).__name__ for p in processors if not hasattr(p, "_attention_backend")})
                raise ValueError(
                    f"{field}: {name!r} needs attention processors that dispatch through diffusers; {kinds} call "
                    f"torch's scaled_dot_product_attention directly: use one of {list(_SDPA_BACKENDS)}"
                )
            sdpa = _SDPA_BACKENDS[name]
            if sdpa is not None:
                from torch.nn.attention import SDPBackend

                self._sdpa = [getattr(SDPBackend, sdpa)]

    def _compile(self, transformer: nn.Module) -> None:
        s = self.settings
        import torch._dynamo.config as dynamo_config

        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, _DYNAMO_RECOMPILE_LIMIT)
        autotune = s.compile_mode == "max-autotune-no-cudagraphs"
        mode = ("max-autotune" if autotune else "reduce-overhead") if s.cuda_graphs else (s.compile_mode)
        kwargs = {} if mode == "default" else {"mode": mode}
        modules = repeated_blocks(transformer) if s.compile_regional else [transformer]
        if not modules:
            modules = [transformer]  # no repeated blocks found: the whole model
        for module in modules:
            module.compile(**kwargs)
        self.compiled_modules = len(modules)

    # ------------------------------------------------------------------------------------------------- calls

    def _on(self, scope: str) -> bool:
        """Whether a speed-up of ``scope`` applies to this call (the path is the gradient mode)."""
        path = "train" if torch.is_grad_enabled() else "rollout"
        return scope in ("both", path)

    @contextmanager
    def bypassed(self) -> Iterator[None]:
        """Every call inside the context runs as without the speed-ups: compiled modules eagerly
        (``torch.compiler.set_stance("force_eager")``, the original forward), no autocast, no ``sdpa_kernel``
        restriction, no CUDA graph. What :meth:`apply` changed on the modules themselves stays: the attention backend
        set on processors that dispatch through diffusers (``set_attention_backend`` is per processor, not per call)
        and the channels-last layout of the VAE (decoding only). Not thread-safe: open it where the transformer is
        called from one thread (the guards run before training)."""
        self._bypass += 1
        try:
            yield
        finally:
            self._bypass -= 1

    @contextmanager
    def _context(self) -> Iterator[bool]:
        s = self.settings
        if self._bypass:
            with ExitStack() as stack:
                if s.compile != "off":
                    stack.enter_context(torch.compiler.set_stance("force_eager"))
                yield False
            return
        compiled = s.compile != "off" and self._on(s.compile)
        with ExitStack() as stack:
            if s.compile != "off" and not compiled:
                stack.enter_context(torch.compiler.set_stance("force_eager"))
            if s.autocast != "off" and self._on(s.autocast_scope):
                stack.enter_context(torch.autocast(self.device.type, dtype=_AUTOCAST[s.autocast]))
            if self._sdpa is not None:
                from torch.nn.attention import sdpa_kernel

                stack.enter_context(sdpa_kernel(self._sdpa))
            if compiled and s.cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()  # type: ignore[no-untyped-call]  # a new replay
            yield compiled and s.cuda_graphs

    def call(self, module: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``module(*args, **kwargs)`` under this call's speed-ups (outputs cloned out of a CUDA graph's pool)."""
        with self._context() as graphed:
            out = module(*args, **kwargs)
        if graphed:
            out = tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in out)
        return out

    def wrap(self, module: nn.Module) -> _AcceleratedModule:
        """A callable standing in for ``module`` in a policy's ``velocity`` (attributes read through)."""
        return _AcceleratedModule(module, self)


class _AcceleratedModule:
    """``module`` called through :meth:`Speedups.call`; every other attribute (``config``, ...) is the module's."""

    def __init__(self, module: nn.Module, speedups: Speedups) -> None:
        self._module = module
        self._speedups = speedups

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._speedups.call(self._module, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)
