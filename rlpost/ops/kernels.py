"""Step kernels: one denoising transition ``x_σ -> x_σ'`` of a rectified-flow model, as pure tensor math.

A kernel turns the model's velocity ``v ≈ ε - x0`` at noise level ``σ`` into the next state at ``σ' < σ``. Stochastic
kernels define a Gaussian policy ``π(x' | x) = N(μ, s² I)`` (as in
Flow-GRPO's ``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py``@ac4c86e) and score the sampled action with
:meth:`StepKernel.log_prob`; samplers call that *same* method at rollout and when recomputing log-probs for the
importance ratio, so the two cannot drift apart (XueZeyue/DanceGRPO issue #87).

Conventions shared by every kernel (the rectified flow of SD3, Esser et al. 2024, arXiv 2403.03206; diffusers
``schedulers/scheduling_flow_match_euler_discrete.py``):

* ``x_σ = (1-σ)·x0 + σ·ε``; clean estimate ``x̂0 = x - σ·v``; noise estimate ``x̂1 = x + (1-σ)·v``.
* ``sigma`` and ``sigma_next`` are ``[B]`` tensors (one noise level per row, so a batch may mix steps); ``dt = σ' - σ``
  is negative.
* All arithmetic is fp32: inputs are cast up first. Flow-GRPO notes that bf16 overflows in the mean/log-prob
  (``sd3_sde_with_logprob.py``); keeping fp32 here means a bf16 transformer still yields fp32 log-probs.
* Log-probs are reduced over every non-batch dimension, by ``"mean"`` (the convention of every anchor codebase) or
  ``"sum"`` (the true log-density of the whole latent). See ``docs/models.md`` for why the choice matters for the
  TreeGRPO backup.

The formulas are restated from the sources cited at each kernel; no upstream code is copied.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

__all__ = [
    "CPSKernel",
    "DanceGRPOSDE",
    "EulerODE",
    "FlowGRPOSDE",
    "KERNELS",
    "LogProbReduction",
    "StepKernel",
    "StepOutput",
    "as_f32",
    "gaussian_log_prob",
    "make_kernel",
    "per_row",
]

LogProbReduction = Literal["mean", "sum"]

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


def as_f32(t: Tensor) -> Tensor:
    """``t`` in fp32 (every kernel computes in fp32, see the module docstring)."""
    return t.to(torch.float32)


def per_row(sigma: Tensor, ndim: int) -> Tensor:
    """``[B]`` -> ``[B, 1, ..., 1]`` (fp32) so it broadcasts against a ``ndim``-dimensional latent batch."""
    s = as_f32(sigma)
    if s.ndim == 0:
        s = s.reshape(1)
    return s.reshape(s.shape[0], *([1] * (ndim - 1)))


def gaussian_log_prob(x: Tensor, mean: Tensor, std: Tensor, reduction: LogProbReduction = "mean") -> Tensor:
    """Log-density of ``x`` under ``N(mean, std² I)``, reduced over all non-batch dimensions.

    ``log N(x; μ, s²) = -(x-μ)²/(2s²) - log s - ½ log 2π`` per element, computed and reduced in
    fp64: a ``sum`` over an SD3.5 latent (~65k elements) reaches 1e4-6e4, where one fp32 ulp (1e-3-4e-3) already
    exceeds the PPO clip range of 1e-4, so fp32 storage alone would make an unchanged policy's ratio differ from 1.

    Args:
        x: ``[B, ...]`` sampled states.
        mean: ``[B, ...]`` Gaussian means.
        std: Standard deviations broadcastable to ``mean`` (typically ``[B, 1, 1, 1]``).
        reduction: ``"mean"`` averages over the latent elements (codebase convention of DDPO, DanceGRPO, Flow-GRPO,
            MixGRPO, BranchGRPO); ``"sum"`` gives the log-density of the whole latent.

    Returns:
        ``[B]`` fp64 log-probabilities.
    """
    x, mean, std = x.double(), mean.double(), std.double()
    elem = -((x - mean) ** 2) / (2.0 * std**2) - torch.log(std) - _HALF_LOG_2PI
    dims = tuple(range(1, elem.ndim))
    if reduction == "mean":
        return elem.mean(dim=dims)
    if reduction == "sum":
        return elem.sum(dim=dims)
    raise ValueError(f"unknown log-prob reduction {reduction!r}; expected 'mean' or 'sum'")


@dataclass(frozen=True)
class StepOutput:
    """Result of one kernel step.

    Attributes:
        next_latents: ``[B, ...]`` fp32 next state ``x' = mean + std·z``.
        mean: ``[B, ...]`` fp32 mean of the step Gaussian.
        std: fp32 std broadcastable to ``mean`` (``[B, 1, ..., 1]``); zeros for deterministic kernels.
        log_prob: ``[B]`` fp32 log-prob of ``next_latents``; NaN for deterministic kernels (no density).
    """

    next_latents: Tensor
    mean: Tensor
    std: Tensor
    log_prob: Tensor


class StepKernel(ABC):
    """A denoising transition rule. Subclasses implement :meth:`mean_std`; sampling and scoring are shared."""

    name: ClassVar[str] = ""
    stochastic: ClassVar[bool] = True

    @abstractmethod
    def mean_std(self, x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor) -> tuple[Tensor, Tensor]:
        """Mean and std of the transition Gaussian.

        Args:
            x: ``[B, ...]`` current states at noise level ``sigma``.
            v: ``[B, ...]`` velocity predicted at ``(x, sigma)`` (guidance already applied).
            sigma: ``[B]`` current noise levels.
            sigma_next: ``[B]`` next noise levels (``< sigma``).

        Returns:
            ``(mean [B, ...], std [B, 1, ..., 1])``, both fp32.
        """

    def log_prob(self, x_next: Tensor, mean: Tensor, std: Tensor, reduction: LogProbReduction = "mean") -> Tensor:
        """Log-prob of ``x_next`` under the step Gaussian; the same function at rollout and training.

        Args:
            x_next: ``[B, ...]`` next states.
            mean: ``[B, ...]`` means from :meth:`mean_std`.
            std: Stds from :meth:`mean_std`.
            reduction: ``"mean"`` or ``"sum"`` over the latent elements.

        Returns:
            ``[B]`` fp32 log-probs (NaN for deterministic kernels).
        """
        if not self.stochastic:
            return torch.full((x_next.shape[0],), float("nan"), dtype=torch.float64, device=x_next.device)
        return gaussian_log_prob(x_next, mean, std, reduction)

    def step(
        self,
        x: Tensor,
        v: Tensor,
        sigma: Tensor,
        sigma_next: Tensor,
        generator: torch.Generator | None,
        reduction: LogProbReduction = "mean",
        noise: Tensor | None = None,
    ) -> StepOutput:
        """Sample ``x' = mean + std·z`` and score it.

        Args:
            x: ``[B, ...]`` current states.
            v: ``[B, ...]`` velocities.
            sigma: ``[B]`` current noise levels.
            sigma_next: ``[B]`` next noise levels.
            generator: RNG for ``z`` (drawn on ``x``'s device in fp32); ignored by deterministic kernels or when
                ``noise`` is given.
            reduction: Log-prob reduction, see :func:`gaussian_log_prob`.
            noise: Optional pre-drawn standard-normal ``z`` (shape of ``x``).

        Returns:
            The :class:`StepOutput`.
        """
        mean, std = self.mean_std(x, v, sigma, sigma_next)
        if not self.stochastic:
            return StepOutput(mean, mean, std, self.log_prob(mean, mean, std, reduction))
        if noise is None:
            noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=torch.float32)
        nxt = mean + std * as_f32(noise)
        return StepOutput(nxt, mean, std, self.log_prob(nxt, mean, std, reduction))

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class EulerODE(StepKernel):
    """Deterministic Euler step of the probability-flow ODE: ``x' = x + (σ'-σ)·v`` (diffusers
    ``FlowMatchEulerDiscreteScheduler.step``).

    This is exactly diffusers' ``FlowMatchEulerDiscreteScheduler.step``; ``std`` is zero and ``log_prob`` NaN.
    """

    name: ClassVar[str] = "ode"
    stochastic: ClassVar[bool] = False

    def mean_std(self, x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor) -> tuple[Tensor, Tensor]:
        x, v = as_f32(x), as_f32(v)
        dt = per_row(sigma_next, x.ndim) - per_row(sigma, x.ndim)
        return x + dt * v, torch.zeros_like(dt)


class FlowGRPOSDE(StepKernel):
    """Flow-GRPO's SDE step (Liu et al. 2025, arXiv 2505.05470, eq. 9-10).

    Restated from ``yifan123/flow_grpo`` ``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py``@54809b5
    (``sde_type="sde"``). With ``dt = σ' - σ``::

        σ_t = a · sqrt(σ / (1 - σ))                       (σ = 1 uses σ_max in the denominator only)
        μ   = x + dt · [ v + σ_t² / (2σ) · (x + (1-σ)·v) ]
        s   = σ_t · sqrt(-dt)

    Args:
        noise_level: ``a``; Flow-GRPO's default 0.7.
        sigma_max: Replaces ``σ`` in ``1 - σ`` where ``σ == 1`` (Flow-GRPO passes ``sigmas[1]``, the second value of
            the schedule). ``None`` uses each row's ``sigma_next`` there, which equals ``sigmas[1]`` for the first
            step of a schedule and so reproduces Flow-GRPO.
    """

    name: ClassVar[str] = "flow-sde"

    def __init__(self, noise_level: float = 0.7, sigma_max: float | None = None) -> None:
        if noise_level < 0:
            raise ValueError(f"noise_level must be >= 0, got {noise_level}")
        self.noise_level = float(noise_level)
        self.sigma_max = sigma_max

    def std_dev_t(self, sigma: Tensor, sigma_next: Tensor, ndim: int) -> Tensor:
        """``σ_t = a·sqrt(σ/(1-σ))`` per row, ``[B, 1, ..., 1]`` (the SDE's diffusion coefficient, §5.2/§5.3)."""
        s = per_row(sigma, ndim)
        cap = per_row(sigma_next, ndim) if self.sigma_max is None else torch.full_like(s, self.sigma_max)
        denom_sigma = torch.where(s >= 1.0, cap, s)
        return self.noise_level * torch.sqrt(s / (1.0 - denom_sigma))

    def mean_std(self, x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor) -> tuple[Tensor, Tensor]:
        x, v = as_f32(x), as_f32(v)
        s = per_row(sigma, x.ndim)
        dt = per_row(sigma_next, x.ndim) - s
        sd = self.std_dev_t(sigma, sigma_next, x.ndim)
        # Flow-GRPO eq. 9: the score-corrected drift of the reverse SDE with marginals matching the ODE.
        mean = x + dt * (v + sd**2 / (2.0 * s) * (x + (1.0 - s) * v))
        return mean, sd * torch.sqrt(-dt)


class DanceGRPOSDE(StepKernel):
    """DanceGRPO's SDE step (``fastvideo/train_grpo_flux.py: flux_step``, same as MixGRPO's ``dance_grpo_step``).

    With ``dt = σ' - σ`` and ``x̂0 = x - σ·v`` (``XueZeyue/DanceGRPO``
    ``fastvideo/train_grpo_flux.py``@15cc71d)::

        ŝ = -(x - (1-σ)·x̂0) / σ²            (score estimate)
        μ = x + dt · (v - ½ η² ŝ)
        s = η · sqrt(σ - σ')

    Args:
        eta: ``η``; DanceGRPO's default 0.3.
    """

    name: ClassVar[str] = "dance-sde"

    def __init__(self, eta: float = 0.3) -> None:
        if eta < 0:
            raise ValueError(f"eta must be >= 0, got {eta}")
        self.eta = float(eta)

    def mean_std(self, x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor) -> tuple[Tensor, Tensor]:
        x, v = as_f32(x), as_f32(v)
        s = per_row(sigma, x.ndim)
        dt = per_row(sigma_next, x.ndim) - s
        x0 = x - s * v
        score = -(x - (1.0 - s) * x0) / s**2
        mean = x + dt * (v - 0.5 * self.eta**2 * score)
        return mean, self.eta * torch.sqrt(-dt)


class CPSKernel(StepKernel):
    """Coefficients-preserving sampling (Flow-GRPO-Fast configs; ``sd3_sde_with_logprob.py``, ``sde_type="cps"``).

    Re-noises the clean estimate so the next state keeps the interpolant's coefficients
    (``yifan123/flow_grpo`` ``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py``@54809b5)::

        s  = σ' · sin(a·π/2)
        μ  = (1-σ')·x̂0 + sqrt(σ'² - s²)·x̂1,      x̂0 = x - σ·v,  x̂1 = x + (1-σ)·v

    Log-prob choice: Flow-GRPO scores CPS actions with ``-mean((x'-μ)²)`` (constants and the ``1/(2s²)`` scaling
    dropped). Here the default is the true Gaussian log-density (``log_prob="gaussian"``), consistent with the other
    kernels so that log-probs of edges from different kernels are comparable (e.g. in a TreeGRPO backup softmax);
    ``log_prob="flow-grpo"`` reproduces Flow-GRPO's surrogate. The importance *ratio* differs between the two: the
    Gaussian one scales the squared error by ``1/(2s²)``.

    At ``σ' = 0`` the std is 0 (the step lands on ``x̂0``); the Gaussian log-prob is then undefined and returned as
    NaN, so such edges must not be trained (Flow-GRPO never trains the last step either).

    Args:
        noise_level: ``a`` in ``[0, 1]``.
        log_prob: ``"gaussian"`` (default) or ``"flow-grpo"``.
    """

    name: ClassVar[str] = "cps"

    def __init__(self, noise_level: float = 0.7, log_prob: Literal["gaussian", "flow-grpo"] = "gaussian") -> None:
        if not 0.0 <= noise_level <= 1.0:
            raise ValueError(f"cps noise_level must be in [0, 1], got {noise_level}")
        if log_prob not in ("gaussian", "flow-grpo"):
            raise ValueError(f"cps log_prob must be 'gaussian' or 'flow-grpo', got {log_prob!r}")
        self.noise_level = float(noise_level)
        self.log_prob_kind = log_prob

    def mean_std(self, x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor) -> tuple[Tensor, Tensor]:
        x, v = as_f32(x), as_f32(v)
        s = per_row(sigma, x.ndim)
        sn = per_row(sigma_next, x.ndim)
        std = sn * math.sin(self.noise_level * math.pi / 2.0)
        x0 = x - s * v
        x1 = x + (1.0 - s) * v
        mean = (1.0 - sn) * x0 + torch.sqrt(torch.clamp(sn**2 - std**2, min=0.0)) * x1
        return mean, std

    def log_prob(self, x_next: Tensor, mean: Tensor, std: Tensor, reduction: LogProbReduction = "mean") -> Tensor:
        if self.log_prob_kind == "flow-grpo":
            # Flow-GRPO's CPS surrogate: negative squared error, no constants or variance scaling. Reduced in fp64
            # like gaussian_log_prob: evaluate_edges and Rollout.old_log_probs hold fp64 log-probs.
            sq = -((x_next.double() - mean.double()) ** 2)
            dims = tuple(range(1, sq.ndim))
            return sq.mean(dim=dims) if reduction == "mean" else sq.sum(dim=dims)
        lp = gaussian_log_prob(x_next, mean, std, reduction)
        zero = (as_f32(std).reshape(std.shape[0], -1) == 0).any(dim=1)
        return torch.where(zero, torch.full_like(lp, float("nan")), lp)


KERNELS: dict[str, type[StepKernel]] = {k.name: k for k in (EulerODE, FlowGRPOSDE, DanceGRPOSDE, CPSKernel)}


def make_kernel(name: str, **kwargs: Any) -> StepKernel:
    """Build a step kernel by name (``"ode"``, ``"flow-sde"``, ``"dance-sde"``, ``"cps"``).

    Args:
        name: Kernel name.
        **kwargs: Constructor arguments of that kernel (e.g. ``noise_level=0.7``).

    Raises:
        ValueError: For an unknown name.
    """
    try:
        cls = KERNELS[name]
    except KeyError:
        raise ValueError(f"unknown step kernel {name!r}; choose one of {sorted(KERNELS)}") from None
    return cls(**kwargs)
