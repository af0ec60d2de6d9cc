"""Step kernels: Gaussian log-probs, sampling moments, limits and DPM-Solver++ against diffusers."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler
from torch.distributions import Normal

from rlpost.ops.dpm_solver import DPMSolverPP2
from rlpost.ops.kernels import (
    KERNELS,
    CPSKernel,
    DanceGRPOSDE,
    EulerODE,
    FlowGRPOSDE,
    StepKernel,
    gaussian_log_prob,
    make_kernel,
)
from rlpost.ops.schedules import sd3_sigmas
from tests.tolerances import assert_fp32_close

SDE_KERNELS = [FlowGRPOSDE(0.7), DanceGRPOSDE(0.3), CPSKernel(0.7)]
SDE_IDS = [k.name for k in SDE_KERNELS]


def _state(b: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 4, 4, 4, generator=g), torch.randn(b, 4, 4, 4, generator=g)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gaussian_log_prob_matches_torch_normal(reduction: str) -> None:
    x, mu = _state()
    std = torch.tensor([0.3, 1.0, 2.5]).view(3, 1, 1, 1)
    ref = Normal(mu, std).log_prob(x)
    ref = ref.mean(dim=(1, 2, 3)) if reduction == "mean" else ref.sum(dim=(1, 2, 3))
    ours = gaussian_log_prob(x, mu, std, reduction)  # type: ignore[arg-type]
    assert ours.shape == (3,) and ours.dtype == torch.float64  # fp64 reduction (see gaussian_log_prob)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-5, check_dtype=False)


def test_gaussian_log_prob_rejects_unknown_reduction() -> None:
    x, mu = _state()
    with pytest.raises(ValueError, match="reduction"):
        gaussian_log_prob(x, mu, torch.ones(3, 1, 1, 1), "max")  # type: ignore[arg-type]


@pytest.mark.parametrize("kernel", SDE_KERNELS, ids=SDE_IDS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_sde_log_prob_equals_normal(kernel: StepKernel, reduction: str) -> None:
    x, v = _state()
    sigma = torch.tensor([1.0, 0.7, 0.3])
    sigma_next = torch.tensor([0.9, 0.5, 0.1])
    out = kernel.step(x, v, sigma, sigma_next, torch.Generator().manual_seed(1), reduction=reduction)  # type: ignore[arg-type]
    assert out.std.shape == (3, 1, 1, 1) and bool((out.std > 0).all())
    ref = Normal(out.mean, out.std).log_prob(out.next_latents)
    ref = ref.mean(dim=(1, 2, 3)) if reduction == "mean" else ref.sum(dim=(1, 2, 3))
    torch.testing.assert_close(out.log_prob, ref, rtol=1e-6, atol=1e-5, check_dtype=False)
    # the scoring function alone gives the same number (rollout and training share it)
    assert torch.equal(kernel.log_prob(out.next_latents, out.mean, out.std, reduction), out.log_prob)  # type: ignore[arg-type]


@pytest.mark.parametrize("kernel", SDE_KERNELS, ids=SDE_IDS)
def test_sde_sample_moments(kernel: StepKernel) -> None:
    n = 20000
    x1, v1 = _state(1)
    x, v = x1.expand(n, -1, -1, -1), v1.expand(n, -1, -1, -1)
    sigma, sigma_next = torch.full((n,), 0.6), torch.full((n,), 0.45)
    out = kernel.step(x, v, sigma, sigma_next, torch.Generator().manual_seed(2))
    mean, std = out.mean[0], out.std[0].reshape(())
    emp_mean = out.next_latents.mean(0)
    emp_std = out.next_latents.std(0)
    se = float(std) / math.sqrt(n)
    assert (emp_mean - mean).abs().max() < 5 * se
    assert (emp_std / std - 1).abs().max() < 0.04


@pytest.mark.parametrize("kernel", SDE_KERNELS, ids=SDE_IDS)
def test_step_uses_given_noise_and_generator(kernel: StepKernel) -> None:
    x, v = _state()
    s, sn = torch.full((3,), 0.8), torch.full((3,), 0.6)
    z = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    a = kernel.step(x, v, s, sn, None, noise=z)
    torch.testing.assert_close(a.next_latents, a.mean + a.std * z)
    b = kernel.step(x, v, s, sn, torch.Generator().manual_seed(5))
    assert torch.equal(a.next_latents, b.next_latents)


@pytest.mark.parametrize("kernel", [FlowGRPOSDE(0.0), DanceGRPOSDE(0.0), CPSKernel(0.0)], ids=SDE_IDS)
def test_zero_noise_reduces_to_euler(kernel: StepKernel) -> None:
    x, v = _state()
    s, sn = torch.tensor([0.9, 0.5, 0.2]), torch.tensor([0.8, 0.3, 0.0])
    mean, _ = kernel.mean_std(x, v, s, sn)
    ode, _ = EulerODE().mean_std(x, v, s, sn)
    torch.testing.assert_close(mean, ode, rtol=1e-6, atol=1e-6)


def test_flow_grpo_formula_and_sigma_one() -> None:
    x, v = _state()
    sig = sd3_sigmas(10, 3.0)
    s, sn = sig[:3].clone(), sig[1:4].clone()  # row 0 starts at sigma = 1
    k = FlowGRPOSDE(0.7)
    mean, std = k.mean_std(x, v, s, sn)
    assert torch.isfinite(mean).all() and torch.isfinite(std).all()
    # Flow-GRPO: sigma == 1 uses sigma_max = sigmas[1] in the denominator; default (None) uses sigma_next there.
    mean2, std2 = FlowGRPOSDE(0.7, sigma_max=float(sig[1])).mean_std(x, v, s, sn)
    # Same values by another code path (a float sigma_max instead of the sigma_next tensor): fp32 rounding apart.
    # Using sigma_max = 1 or sigma = 1 there instead divides by zero or moves the mean by O(1).
    assert_fp32_close(mean, mean2)
    assert_fp32_close(std, std2)
    # independent restatement of Flow-GRPO's SDE (arXiv 2505.05470, eq. 9-10) for the interior rows
    for i in (1, 2):
        si, sni = float(s[i]), float(sn[i])
        dt = sni - si
        st = 0.7 * math.sqrt(si / (1 - si))
        ref = x[i] + dt * (v[i] + st**2 / (2 * si) * (x[i] + (1 - si) * v[i]))
        torch.testing.assert_close(mean[i], ref, rtol=1e-5, atol=1e-5)
        assert math.isclose(float(std[i]), st * math.sqrt(-dt), rel_tol=1e-5)


def test_dance_grpo_formula() -> None:
    x, v = _state()
    s, sn = torch.tensor([0.9, 0.5, 0.2]), torch.tensor([0.8, 0.3, 0.0])
    mean, std = DanceGRPOSDE(0.3).mean_std(x, v, s, sn)
    for i in range(3):
        si, sni = float(s[i]), float(sn[i])
        x0 = x[i] - si * v[i]
        score = -(x[i] - (1 - si) * x0) / si**2
        ref = x[i] + (sni - si) * (v[i] - 0.5 * 0.09 * score)
        torch.testing.assert_close(mean[i], ref, rtol=1e-5, atol=1e-5)
        assert math.isclose(float(std[i]), 0.3 * math.sqrt(si - sni), rel_tol=1e-6)


def test_cps_final_step_and_flow_grpo_logprob() -> None:
    x, v = _state()
    s, sn = torch.tensor([0.5, 0.5, 0.5]), torch.tensor([0.3, 0.3, 0.0])
    out = CPSKernel(0.7).step(x, v, s, sn, torch.Generator().manual_seed(0))
    assert torch.isfinite(out.log_prob[:2]).all() and torch.isnan(out.log_prob[2])
    torch.testing.assert_close(out.next_latents[2], x[2] - 0.5 * v[2])  # lands on x̂0
    fg = CPSKernel(0.7, log_prob="flow-grpo")
    lp = fg.log_prob(out.next_latents, out.mean, out.std)
    torch.testing.assert_close(lp, -((out.next_latents - out.mean) ** 2).mean(dim=(1, 2, 3)), check_dtype=False)


def test_euler_matches_diffusers_scheduler_and_has_no_density() -> None:
    x, v = _state(1)
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(5)
    sig = sd3_sigmas(5, 3.0)
    k = EulerODE()
    ours = x.clone()
    theirs = x.clone()
    for i, t in enumerate(sched.timesteps):
        theirs = sched.step(v, t, theirs, return_dict=False)[0]
        out = k.step(ours, v, sig[i : i + 1], sig[i + 1 : i + 2], None)
        ours = out.next_latents
        assert torch.isnan(out.log_prob).all() and bool((out.std == 0).all())
    # Same formula x + (σ' - σ)·v, computed by two libraries: fp32 rounding apart (docs/models.md does not promise the
    # kernel bit for bit). An off-by-one sigma moves the result by ~0.1.
    assert_fp32_close(ours, theirs)


def test_rows_with_different_sigmas_equal_separate_calls() -> None:
    x, v = _state()
    s, sn = torch.tensor([0.9, 0.5, 0.2]), torch.tensor([0.8, 0.3, 0.05])
    for k in SDE_KERNELS:
        mean, std = k.mean_std(x, v, s, sn)
        for i in range(3):
            m_i, s_i = k.mean_std(x[i : i + 1], v[i : i + 1], s[i : i + 1], sn[i : i + 1])
            torch.testing.assert_close(mean[i : i + 1], m_i)
            torch.testing.assert_close(std[i : i + 1], s_i)


def test_low_precision_inputs_give_fp32() -> None:
    x, v = _state()
    out = FlowGRPOSDE().step(x.bfloat16(), v.bfloat16(), torch.full((3,), 0.5), torch.full((3,), 0.4), None)
    assert out.next_latents.dtype == out.mean.dtype == torch.float32 and out.log_prob.dtype == torch.float64


def test_make_kernel() -> None:
    assert set(KERNELS) == {"ode", "flow-sde", "dance-sde", "cps"}
    k = make_kernel("flow-sde", noise_level=0.5)
    assert isinstance(k, FlowGRPOSDE) and k.noise_level == 0.5 and k.stochastic
    assert not make_kernel("ode").stochastic
    with pytest.raises(ValueError, match="unknown step kernel"):
        make_kernel("nope")


@pytest.mark.parametrize("num_steps", [4, 7, 12])
def test_dpm_solver_pp2_matches_diffusers(num_steps: int) -> None:
    """On a linear velocity field, our DPM-Solver++(2M) reproduces diffusers' DPMSolverMultistepScheduler in flow mode.

    diffusers: algorithm_type dpmsolver++, solver_order 2, midpoint, flow_prediction, final_sigmas_type zero (the last
    step is first order, landing on x̂0).
    """
    sched = DPMSolverMultistepScheduler(
        use_flow_sigmas=True,
        prediction_type="flow_prediction",
        flow_shift=3.0,
        algorithm_type="dpmsolver++",
        solver_order=2,
        solver_type="midpoint",
        final_sigmas_type="zero",
        lower_order_final=True,
    )
    sched.set_timesteps(num_steps)
    sig = sched.sigmas.to(torch.float32)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(2, 4, 4, 4, generator=g) * 0.3
    b = torch.randn(2, 4, 4, 4, generator=g)

    def field(x: torch.Tensor, s: float) -> torch.Tensor:
        return a * x + b * (1 + s)

    x_ref = torch.randn(2, 4, 4, 4, generator=g)
    x = x_ref.clone()
    solver = DPMSolverPP2()
    for i, t in enumerate(sched.timesteps):
        s = float(sig[i])
        x_ref = sched.step(field(x_ref, s), t, x_ref, return_dict=False)[0]
        x, x0 = solver.step(x, field(x, s), sig[i].expand(2), sig[i + 1].expand(2))
        torch.testing.assert_close(x, x_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x, x0)  # the final step returns x̂0


def test_dpm_solver_pp2_first_step_is_ddim_and_state_resets() -> None:
    x, v = _state(1)
    s, sn = torch.tensor([0.8]), torch.tensor([0.5])
    solver = DPMSolverPP2()
    nxt, x0 = solver.step(x, v, s, sn)
    # order 1 (DDIM in data prediction): x' = (σ'/σ)x + α'(1 - σ'(1-σ)/(σ(1-σ')))... restated via x̂0:
    # x' = σ'/σ·x + (1-σ')(1 - (σ'/σ)(1-σ)/(1-σ'))·x̂0 = (1-σ')x̂0 + σ'·(x - (1-σ)x̂0)/σ
    eps_hat = (x - 0.2 * x0) / 0.8
    torch.testing.assert_close(nxt, 0.5 * x0 + 0.5 * eps_hat, rtol=1e-5, atol=1e-5)
    solver.reset()
    again, _ = solver.step(x, v, s, sn)
    assert torch.equal(again, nxt)
