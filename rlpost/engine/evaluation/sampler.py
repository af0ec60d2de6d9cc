"""The held-out sampler, shared with ``rlpost sample``: deterministic Euler-ODE images along the run's time grid.

Deliberately tiny: initial noise from the policy, then ``EulerODE`` steps along ``policy.sigmas``, then decode, which is
what ``StableDiffusion3Pipeline.__call__`` does for the SD3 adapter on its default grid. ``policy.sigmas`` is the run's
one time grid (``model.init_args.time_grid``, ``docs/models.md`` "Time grids"), so evaluation steps through the same
noise levels as the training samplers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from rlpost.core.api import Policy
from rlpost.ops.kernels import EulerODE

__all__ = ["ode_sample"]


@torch.no_grad()
def ode_sample(policy: Policy, prompts: Sequence[str], seeds: Sequence[int], num_steps: int, batch_size: int) -> Tensor:
    """Deterministic Euler-ODE samples, one per ``(prompt, seed)``, as ``[N, F, H, W, 3]`` uint8 media on the CPU
    (:meth:`Policy.decode`'s frames; ``F = 1`` for an image model).

    Each image's initial noise comes from its own CPU generator seeded with its seed, so results do not depend on
    ``batch_size`` or on the device (diffusers' ``generator=torch.Generator().manual_seed(seed)`` convention).
    """
    kernel = EulerODE()
    sigmas = policy.sigmas(num_steps)
    out: list[Tensor] = []
    for start in range(0, len(prompts), batch_size):
        chunk = list(prompts[start : start + batch_size])
        noise = [
            policy.initial_noise(1, torch.Generator().manual_seed(int(s))) for s in seeds[start : start + batch_size]
        ]
        x = torch.cat(noise).to(policy.device)
        cond = policy.encode(chunk)
        n = x.shape[0]
        for i in range(num_steps):
            s, s_next = sigmas[i].expand(n), sigmas[i + 1].expand(n)
            x = kernel.step(x, policy.velocity(x, s, cond), s, s_next, None).next_latents
        out.append(policy.decode(x).cpu())
    return torch.cat(out)
