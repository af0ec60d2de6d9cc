"""DiffusionNFT's loss against the paper's equations, and where its gradient flows.

The expected values are written here from arXiv 2509.16117 (Sec. 3: the implicit positive and negative policies and
the optimality-weighted loss; the adaptive x0-space weighting of its appendix / NVlabs/DiffusionNFT
``scripts/train_nft_sd3.py`` @24af555 L940-957) in *velocity* space, ``x̂0± - x0 = t·(v - v±)`` with the
flow-matching target ``v = ε - x0``, not by the module's x0-space arithmetic. Everything runs in fp64, so the two
paths agree to rounding (relative 1e-9 leaves ~1e5 ulps for the cancellation in ``x_t - x0`` at small ``t``).
"""

from __future__ import annotations

import pytest
import torch

from rlpost_nft.loss import WEIGHT_FLOOR, adaptive_x0_loss, nft_loss, optimality_weight

RTOL = 1e-9
M = 5.0  # adv_clip_max


def _batch(seed: int = 0, rows: int = 5, shape: tuple[int, ...] = (2, 3, 3)) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g, dtype=torch.float64)

    x0, eps = randn(rows, *shape), randn(rows, *shape)
    t = torch.tensor([1.0, 0.7, 0.31, 0.05, 0.5], dtype=torch.float64)[:rows]
    tb = t.view(-1, 1, 1, 1)
    v_old = (eps - x0) + 0.3 * randn(rows, *shape)
    v_theta = v_old + 0.1 * randn(rows, *shape)
    v_ref = v_old + 0.2 * randn(rows, *shape)
    # Last row: both implicit policies hit the target to 1e-7, so the mean absolute error falls below the floor.
    v_old[-1] = v_theta[-1] = (eps - x0)[-1] + 1e-7
    adv = torch.tensor([-7.0, -2.5, 0.0, 2.5, 9.0], dtype=torch.float64)[:rows]
    return {"x0": x0, "eps": eps, "t": t, "x_t": (1 - tb) * x0 + tb * eps, "v_old": v_old, "v_theta": v_theta,
            "v_ref": v_ref, "adv": adv}  # fmt: skip


def _paper_loss(b: dict[str, torch.Tensor], beta: float, kl_beta: float) -> torch.Tensor:
    """Per-row loss from the paper's equations, in velocity space."""
    target = b["eps"] - b["x0"]
    r = 0.5 + 0.5 * torch.clamp(b["adv"] / M, -1.0, 1.0)  # optimality probability, Z = adv_clip_max
    v_pos = (1 - beta) * b["v_old"] + beta * b["v_theta"]
    v_neg = (1 + beta) * b["v_old"] - beta * b["v_theta"]
    out = []
    for i in range(target.shape[0]):
        t = float(b["t"][i])
        per_policy = []
        for v in (v_pos[i], v_neg[i]):
            err = t * (target[i] - v)  # x̂0 - x0
            w = max(float(err.abs().mean()), WEIGHT_FLOOR)
            per_policy.append(float((err**2).mean()) / w)
        pos, neg = per_policy
        kl = float(((b["v_theta"][i] - b["v_ref"][i]) ** 2).mean())
        out.append(M * (float(r[i]) * pos + (1 - float(r[i])) * neg) / beta + kl_beta * kl)
    return torch.tensor(out, dtype=torch.float64)


def test_optimality_weight_matches_the_paper():
    adv = torch.tensor([-100.0, -5.0, -2.5, 0.0, 1.0, 5.0, 42.0])
    assert optimality_weight(adv, M).tolist() == pytest.approx([0.0, 0.0, 0.25, 0.5, 0.6, 1.0, 1.0], abs=1e-7)


@pytest.mark.parametrize(("beta", "kl_beta"), [(1.0, 1e-4), (0.1, 0.0), (0.1, 0.5)])
def test_loss_equals_the_papers_equations(beta, kl_beta):
    b = _batch()
    terms = nft_loss(
        b["v_theta"], b["v_old"], b["x0"], b["x_t"], b["t"], optimality_weight(b["adv"], M),
        beta=beta, adv_clip_max=M, v_ref=b["v_ref"], kl_beta=kl_beta,
    )  # fmt: skip
    expected = _paper_loss(b, beta, kl_beta)
    torch.testing.assert_close(terms.total, expected, rtol=RTOL, atol=1e-15)
    # The floor row: both errors ~1e-7·t, far below the floor, so each loss is mean(err²)/1e-5 ~ 1e-9.
    assert float(terms.positive[-1]) < 1e-8 and float(terms.negative[-1]) < 1e-8


def test_adaptive_weight_normalises_each_row():
    """``L = mean(e²)/mean|e|``: scaling one row's error by 10 scales its loss by 10, not 100."""
    x0 = torch.zeros(2, 4, dtype=torch.float64)
    pred = torch.tensor([[1.0, -1.0, 2.0, 0.0], [10.0, -10.0, 20.0, 0.0]], dtype=torch.float64)
    loss = adaptive_x0_loss(pred, x0)
    assert loss.tolist() == pytest.approx([6.0 / 4 / 1.0, 600.0 / 4 / 10.0], rel=1e-12)


def test_gradient_flows_only_into_the_live_velocity():
    """The gradient is the hand derivative that holds ``v_old``, ``v_ref`` and the weights ``w±`` constant; no
    gradient reaches ``v_old`` or ``v_ref`` even when they require one (a ``w`` that carried gradient would add
    ``-e²/w²·∂w`` terms and break the equality)."""
    beta, kl_beta = 0.4, 0.3
    b = _batch(seed=3)
    v_theta = b["v_theta"].clone().requires_grad_(True)
    v_old = b["v_old"].clone().requires_grad_(True)
    v_ref = b["v_ref"].clone().requires_grad_(True)
    r = optimality_weight(b["adv"], M)
    terms = nft_loss(v_theta, v_old, b["x0"], b["x_t"], b["t"], r, beta=beta, adv_clip_max=M, v_ref=v_ref,
                     kl_beta=kl_beta)  # fmt: skip
    terms.total.sum().backward()
    assert v_old.grad is None and v_ref.grad is None

    n = b["x0"][0].numel()
    t = b["t"].view(-1, 1, 1, 1)
    rb = r.view(-1, 1, 1, 1)
    with torch.no_grad():
        e_pos = b["x_t"] - t * (beta * v_theta + (1 - beta) * v_old) - b["x0"]
        e_neg = b["x_t"] - t * ((1 + beta) * v_old - beta * v_theta) - b["x0"]
        w_pos = e_pos.abs().flatten(1).mean(1).clamp_min(WEIGHT_FLOOR).view(-1, 1, 1, 1)
        w_neg = e_neg.abs().flatten(1).mean(1).clamp_min(WEIGHT_FLOOR).view(-1, 1, 1, 1)
        d_pos = 2 * e_pos * (-t * beta) / w_pos / n  # ∂L⁺/∂v_θ
        d_neg = 2 * e_neg * (t * beta) / w_neg / n  # ∂L⁻/∂v_θ
        expected = M / beta * (rb * d_pos + (1 - rb) * d_neg) + kl_beta * 2 * (v_theta - v_ref) / n
    torch.testing.assert_close(v_theta.grad, expected, rtol=RTOL, atol=1e-15)


def test_beta_one_positive_policy_is_the_live_velocity():
    """With β = 1, ``v⁺ = v_θ`` and ``v⁻ = 2·v_old - v_θ``: a live policy equal to the old one gives L⁺ = L⁻."""
    b = _batch(seed=5)
    terms = nft_loss(b["v_old"], b["v_old"], b["x0"], b["x_t"], b["t"], torch.full((5,), 0.3, dtype=torch.float64),
                     beta=1.0, adv_clip_max=M)  # fmt: skip
    torch.testing.assert_close(terms.positive, terms.negative, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(terms.policy, M * terms.positive, rtol=1e-12, atol=1e-15)
    assert not terms.kl.any()
