"""``check_policy``: a :class:`~rlpost.core.api.Policy` (model adapter) against its contract, after ``setup``.

Samplers, update rules and the evaluator are written once against this interface, so each method must keep its
promise (``rlpost/core/api/policy.py``):

* ``sigmas(T)`` is ``[T + 1]`` fp32, from 1 down to 0, strictly decreasing;
* ``initial_noise(n, generator)`` is ``[n, *latent_shape]`` fp32, drawn from the generator alone (same seed, same
  noise; another seed, other noise);
* ``encode`` gives one conditioning row per prompt, and ``select`` picks rows;
* ``velocity`` keeps the latents' shape, is fp32 and finite, adds exactly ``B`` to ``forward_count`` (the cost
  models count rows this way), does not depend on the batch (one row alone equals it in a batch, within fp32
  rounding), and carries gradients to the trainable parameters;
* ``velocity(..., guidance=None)`` equals the call without it (the configured guidance); ``guidance=1.0`` is the
  conditional branch alone: it adds ``B`` to ``forward_count`` and gives the same result with the negative-prompt
  tensors (``negative_*``) dropped from the conditioning; a guidance below 1 or NaN raises ``ValueError``, and so does
  one above 1 that an adapter without negative rows cannot apply;
* ``decode`` gives ``[B, F, H, W, 3]`` uint8 media with ``F = frames`` (1 for an image model), and ``media`` is
  ``"image"`` or ``"video"``; ``trainable_parameters`` is a non-empty list of parameters that
  require gradients; ``clean_tail_steps`` is ``None`` or an integer ``>= 0``; ``train`` toggles without error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from rlpost.core.api import Conditioning, Policy
from rlpost.testing.inputs import PROMPTS
from rlpost.testing.violations import Checker, same_state

__all__ = ["check_policy"]


def check_policy(
    policy: Policy, *, num_steps: int = 4, batch: int = 2, seed: int = 0, rtol: float = 1e-5, atol: float = 1e-6
) -> None:
    """Check a set-up ``policy`` against the model-adapter contract (the module docstring lists the rules).

    Args:
        policy: The adapter, after ``setup(device)`` (:func:`rlpost.testing.tiny_policy` for the built-in ones).
        num_steps: Length of the time grid to check.
        batch: Rows per ``velocity`` call.
        seed: Seed of the noise generators.
        rtol: Relative tolerance between one row alone and in a batch.
        atol: Absolute tolerance for the same.

    Raises:
        ConformanceError: Listing every broken rule.
    """
    check = Checker("policy", policy)
    check.expect(isinstance(policy.device, torch.device), f"device must be a torch.device, got {policy.device!r}")
    _check_sigmas(check, policy, num_steps)
    noise = _check_noise(check, policy, batch, seed)
    prompts = list(PROMPTS[:batch])
    cond = check.call("encode()", policy.encode, prompts)
    if cond is not None and check.expect(isinstance(cond, Conditioning), "encode() must return rlpost.Conditioning"):
        rows = {name: int(t.shape[0]) for name, t in cond.tensors.items()}
        check.expect(all(r == batch for r in rows.values()), f"encode() of {batch} prompts gave rows {rows}")
        if noise is not None:
            _check_velocity(check, policy, noise, cond, rtol, atol)
    params = check.call("trainable_parameters()", policy.trainable_parameters)
    if params is not None:
        check.expect(bool(params), "trainable_parameters() is empty: nothing could be trained")
        check.expect(
            all(isinstance(p, torch.nn.Parameter) and p.requires_grad for p in params),
            "trainable_parameters() must be nn.Parameters that require gradients",
        )
    tail = check.call("clean_tail_steps()", policy.clean_tail_steps)
    check.expect(
        tail is None or (isinstance(tail, int) and not isinstance(tail, bool) and tail >= 0),
        f"clean_tail_steps() must be None or an integer >= 0, got {tail!r}",
    )
    check.ran("train(True)", policy.train, True)
    check.ran("train(False)", policy.train, False)
    if noise is not None:
        media = check.call("decode()", policy.decode, noise)
        frames = policy.frames
        if isinstance(media, Tensor):
            check.expect(
                media.dtype == torch.uint8
                and media.ndim == 5
                and media.shape[:2] == (batch, frames)
                and media.shape[-1] == 3,
                f"decode() must give [{batch}, {frames}, H, W, 3] uint8 (frames = {frames}), "
                f"got {media.dtype} {list(media.shape)}",
            )
    check.expect(policy.media in ("image", "video"), f"media must be 'image' or 'video', got {policy.media!r}")
    check.done()


def _check_sigmas(check: Checker, policy: Policy, num_steps: int) -> None:
    sigmas = check.call("sigmas()", policy.sigmas, num_steps)
    if not isinstance(sigmas, Tensor):
        return
    if not check.expect(
        sigmas.shape == (num_steps + 1,) and sigmas.dtype == torch.float32,
        f"sigmas({num_steps}) must be [{num_steps + 1}] fp32, got {sigmas.dtype} {list(sigmas.shape)}",
    ):
        return
    s = sigmas.double()
    check.expect(abs(float(s[0]) - 1.0) <= 1e-6 and float(s[-1]) == 0.0, "sigmas must run from 1 down to 0")
    check.expect(bool((s[1:] < s[:-1]).all()), f"sigmas must strictly decrease: {sigmas.tolist()}")


def _check_noise(check: Checker, policy: Policy, batch: int, seed: int) -> Tensor | None:
    noise = check.call("initial_noise()", policy.initial_noise, batch, torch.Generator().manual_seed(seed))
    if not isinstance(noise, Tensor):
        return None
    check.expect(
        noise.dtype == torch.float32 and noise.shape[0] == batch,
        f"initial_noise({batch}) must be [{batch}, ...] fp32, got {noise.dtype} {list(noise.shape)}",
    )
    same = policy.initial_noise(batch, torch.Generator().manual_seed(seed))
    other = policy.initial_noise(batch, torch.Generator().manual_seed(seed + 1))
    check.expect(same_state(same, noise), "initial_noise() with the same generator seed gave other noise")
    check.expect(not torch.equal(other, noise), "initial_noise() ignores its generator")
    return noise


def _check_velocity(check: Checker, policy: Policy, x: Tensor, cond: Conditioning, rtol: float, atol: float) -> None:
    b = int(x.shape[0])
    sigma = torch.full((b,), 0.5, device=x.device)
    start = policy.forward_count
    with torch.no_grad():
        v = check.call("velocity()", policy.velocity, x, sigma, cond)
    rows = policy.forward_count - start
    if not isinstance(v, Tensor):
        return
    check.expect(rows == b, f"velocity() of {b} rows added {rows} to forward_count")
    if not check.expect(
        v.shape == x.shape and v.dtype == torch.float32,
        f"velocity() must keep the latents' shape {list(x.shape)} in fp32, got {v.dtype} {list(v.shape)}",
    ):
        return
    check.expect(bool(torch.isfinite(v).all()), "velocity() returned non-finite values")
    with torch.no_grad():
        one = check.call("velocity()", policy.velocity, x[:1], sigma[:1], cond.select(torch.tensor([0])))
    if isinstance(one, Tensor) and one.shape == v[:1].shape:
        check.expect(
            bool(torch.allclose(one, v[:1], rtol=rtol, atol=atol)),
            f"velocity() depends on the batch: row 0 alone differs by {float((one - v[:1]).abs().max()):.3g}",
        )
    _check_guidance(check, policy, x, sigma, cond, v, rtol, atol)
    params = [p for p in policy.trainable_parameters() if p.requires_grad]
    if not params:
        return
    policy.train(True)
    try:
        out = policy.velocity(x, sigma, cond)
        grads = torch.autograd.grad(out.square().sum(), params, allow_unused=True)
    finally:
        policy.train(False)
    moved = [g for g in grads if g is not None and bool(g.abs().sum() > 0)]
    check.expect(bool(moved), "velocity() carries no gradient to the trainable parameters")
    check.expect(all(bool(torch.isfinite(g).all()) for g in moved), "velocity() gives non-finite gradients")


def _check_guidance(
    check: Checker, policy: Policy, x: Tensor, sigma: Tensor, cond: Conditioning, v: Tensor, rtol: float, atol: float
) -> None:
    """The per-call ``guidance`` of ``velocity`` (``v``: its result without the argument)."""
    b = int(x.shape[0])
    with torch.no_grad():
        default = check.call("velocity(guidance=None)", policy.velocity, x, sigma, cond, guidance=None)
        if isinstance(default, Tensor):
            check.expect(
                default.shape == v.shape and bool(torch.allclose(default, v, rtol=rtol, atol=atol)),
                "velocity(guidance=None) differs from velocity() without it: None must be the configured guidance",
            )
        positive = Conditioning({k: t for k, t in cond.tensors.items() if not k.startswith("negative_")})
        start = policy.forward_count
        what = "velocity(guidance=1.0) without the negative_* tensors"
        alone = check.call(what, policy.velocity, x, sigma, positive, guidance=1.0)
        rows = policy.forward_count - start
        if isinstance(alone, Tensor):
            check.expect(rows == b, f"velocity(guidance=1.0) of {b} rows added {rows} to forward_count")
            check.expect(
                alone.shape == x.shape and alone.dtype == torch.float32 and bool(torch.isfinite(alone).all()),
                f"{what} must be finite fp32 of shape {list(x.shape)}, got {alone.dtype} {list(alone.shape)}",
            )
            full = check.call("velocity(guidance=1.0)", policy.velocity, x, sigma, cond, guidance=1.0)
            if isinstance(full, Tensor) and full.shape == alone.shape:
                check.expect(
                    bool(torch.allclose(full, alone, rtol=rtol, atol=atol)),
                    "velocity(guidance=1.0) depends on the negative-prompt rows: it must be the conditional branch",
                )
        for bad in (0.5, float("nan")):
            exc = _raised(policy.velocity, x, sigma, cond, guidance=bad)
            check.expect(
                isinstance(exc, ValueError),
                f"velocity(guidance={bad}) must raise ValueError (below 1 or not finite), {_outcome(exc)}",
            )
        if len(positive.tensors) == len(cond.tensors):  # no negative rows: a scale above 1 is applied or refused
            exc = _raised(policy.velocity, x, sigma, cond, guidance=2.0)
            check.expect(
                exc is None or isinstance(exc, ValueError),
                "velocity(guidance=2.0) without negative-prompt rows must apply the scale or raise ValueError naming "
                f"the setting, {_outcome(exc)}",
            )


def _raised(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Exception | None:
    """The exception ``fn(*args, **kwargs)`` raises, or ``None``."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a component's exception is a finding, not a crash of the kit
        return exc
    return None


def _outcome(exc: Exception | None) -> str:
    return "but it returned" if exc is None else f"but it raised {type(exc).__name__}: {str(exc)[:200]}"
