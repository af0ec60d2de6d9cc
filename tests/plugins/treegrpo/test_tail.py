"""TreeGRPO's cheap tails (``tail``, ``tail_steps``, ``tail_grid``) on a flow whose ODE is solved in closed form.

For Gaussian data ``x0 ~ N(μ, s²I)`` the rectified flow ``x_σ = (1-σ)·x0 + σ·ε`` has marginals
``N((1-σ)μ, c(σ)²I)`` with ``c(σ)² = (1-σ)²s² + σ²``, and its probability-flow ODE moves every point along its
quantile: ``x_σ' = m(σ') + c(σ')·(x_σ - m(σ))/c(σ)`` with ``m(σ) = (1-σ)μ``. The exact velocity is
``v(x, σ) = -μ + c'(σ)·(x - m(σ))/c(σ)`` (smooth, nonlinear in σ), so a tail solver's error against the exact end
point is measurable, and its order too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import pytest
import torch
from torch import Tensor, nn

from rlpost.core.api import Conditioning, Policy, resolve_guidance
from rlpost.core.contract import PromptBatch, Rollout
from rlpost.ops.dpm_solver import dpm_solver_pp2_step
from rlpost_treegrpo.sampler import TreeSampler
from tests.argument_checks import problems_of
from tests.tolerances import assert_fp32_close

MU, S = 0.7, 0.5


def _c(sigma: Tensor) -> Tensor:
    return torch.sqrt((1 - sigma) ** 2 * S**2 + sigma**2)


def exact_between(x: Tensor, sigma: float, target: float) -> Tensor:
    """Where the exact ODE takes ``x`` from level ``sigma`` to level ``target``."""
    s = torch.tensor(sigma, dtype=torch.float64)
    t = torch.tensor(target, dtype=torch.float64)
    return (1 - t) * MU + _c(t) * (x.double() - (1 - s) * MU) / _c(s)


def exact_end(x: Tensor, sigma: float) -> Tensor:
    """Where the exact ODE takes ``x`` at level ``sigma`` when it reaches ``σ = 0``."""
    return exact_between(x, sigma, 0.0)


class GaussianFlowPolicy(Policy):
    """The exact velocity of Gaussian data (float64 inside, fp32 out); counts rows and calls like a real adapter."""

    name: ClassVar[str] = "gaussian-flow-test"

    def __init__(self) -> None:
        self.forward_count = 0
        self.calls = 0

    def setup(self, device: torch.device) -> None:
        pass

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def sigmas(self, num_steps: int) -> Tensor:
        return torch.linspace(1.0, 0.0, num_steps + 1)

    def initial_noise(self, num: int, generator: torch.Generator) -> Tensor:
        return torch.randn((num, 1, 4, 4), generator=generator)

    def encode(self, prompts: Sequence[str]) -> Conditioning:
        return Conditioning({"row": torch.arange(len(prompts), dtype=torch.float32)})

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance: float | None = None) -> Tensor:
        resolve_guidance(guidance, 1.0, can_guide=False)  # an exact field: no guidance to apply
        self.forward_count += latents.shape[0]
        self.calls += 1
        x = latents.double()
        s = sigma.double().view(-1, 1, 1, 1)
        c = _c(s)
        dc = (s - (1 - s) * S**2) / c
        return (-MU + dc * (x - (1 - s) * MU) / c).float()

    def decode(self, latents: Tensor) -> Tensor:
        img = ((latents.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        return img.repeat(1, 3, 1, 1).permute(0, 2, 3, 1).unsqueeze(1).contiguous()  # [B, 1, H, W, 3]: one frame

    def trainable_parameters(self) -> list[nn.Parameter]:
        return []


def grow(sampler: TreeSampler, policy: Policy, seed: int = 0, groups: int = 2) -> Rollout:
    batch = PromptBatch(prompts=[f"p{i}" for i in range(groups)], metadata=[{}] * groups, samples_per_group=1)
    sampler.begin_step(0, torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        return sampler.rollout(policy, batch, torch.Generator().manual_seed(seed))


def tail_error(sampler: TreeSampler) -> float:
    """Max abs error of the decoded leaves against the exact ODE from each window leaf."""
    rollout = grow(sampler, GaussianFlowPolicy())
    end = int(rollout.stats["tree/window_start"]) + sampler.depth
    leaf_nodes = (rollout.node_step == end).nonzero().flatten()
    leaves = rollout.states[leaf_nodes]
    final = rollout.states[rollout.sample_node]
    sigma_end = float(rollout.sigmas[end])
    return float((final.double() - exact_end(leaves, sigma_end)).abs().max())


def make(tail: str = "full", steps: int = 40, start: int = 0, **kw: Any) -> TreeSampler:
    sampler = TreeSampler(num_steps=steps, k=2, depth=2, window="fixed", fixed_start=start, tail=tail, **kw)  # type: ignore[arg-type]
    assert sampler.validate(None) == []
    return sampler


def test_dpm_solver_step_is_second_order_on_a_log_snr_grid() -> None:
    """The tail's step function on this field: halving a uniform-λ grid (between σ = 0.7 and 0.05, where λ is
    finite) divides the end-point error by ~4 (order 2); Euler on the same grid only by ~2."""
    policy, cond = GaussianFlowPolicy(), Conditioning({})
    x_start = torch.randn(16, 1, 4, 4, generator=torch.Generator().manual_seed(0))

    def lam(s: float) -> float:
        return math.log((1 - s) / s)

    def solve(n: int, order2: bool) -> float:
        lams = torch.linspace(lam(0.7), lam(0.05), n + 1, dtype=torch.float64)
        grid = (1 / (1 + torch.exp(lams))).float()
        x, prev_s, prev_x0 = x_start.clone(), None, None
        for i in range(n):
            s, sn = grid[i].expand(16), grid[i + 1].expand(16)
            x, x0 = dpm_solver_pp2_step(x, policy.velocity(x, s, cond), s, sn, prev_s, prev_x0)
            if order2:
                prev_s, prev_x0 = s, x0
        target = exact_between(x_start, float(grid[0]), float(grid[-1]))
        return float((x.double() - target).abs().max())

    dpm = [solve(n, True) for n in (16, 32, 64)]
    euler = [solve(n, False) for n in (16, 32, 64)]  # order 1 of DPM-Solver++ is the Euler step of the flow
    for a, b in zip(dpm, dpm[1:], strict=False):
        assert math.log2(a / b) > 1.8, dpm
    for a, b in zip(euler, euler[1:], strict=False):
        assert 0.7 < math.log2(a / b) < 1.3, euler


def test_dpm_tail_converges_and_beats_euler_at_equal_nfe() -> None:
    """Through the sampler (tail to σ = 0 on MixGRPO-Flash's grid, shift 1): DPM-Solver++ errors shrink with the
    tail's NFE and are several times below Euler's at equal NFE, whose error halves per doubling (order 1).

    The tail's last step goes to σ = 0 (λ = ∞, order 1 by design) and the steps before it keep O(1) widths in λ,
    so the sampler-level error approaches order 2 only slowly; the order itself is checked above."""
    ns = (4, 16, 64)

    def err(tail: str, n: int) -> float:
        return tail_error(make(tail, steps=100, start=28, tail_steps=n, tail_grid="compressed", tail_shift=1.0))

    dpm = [err("dpm-solver++", n) for n in ns]
    euler = [err("euler", n) for n in ns]
    assert dpm[0] > dpm[1] > dpm[2], dpm
    assert all(d < e / 3 for d, e in zip(dpm[1:], euler[1:], strict=True)), (dpm, euler)
    for a, b in zip(euler, euler[1:], strict=False):
        assert 1.6 < math.log2(a / b) < 2.4, euler  # two doublings per entry: order 1


def test_tails_on_the_run_grid_converge_past_the_full_tail() -> None:
    """Subsampling the run's own grid (40 steps, window at σ = 1): the more tail steps, the closer DPM-Solver++ gets
    to the exact end point; at 12 NFE it is already more accurate than the paper's 38-step Euler tail."""
    full = tail_error(make("full"))
    errs = [tail_error(make("dpm-solver++", tail_steps=n)) for n in (3, 6, 12, 38)]
    assert errs[0] > errs[1] > errs[2], errs
    assert errs[2] < full and errs[3] < full, (errs, full)


@pytest.mark.parametrize(
    ("tail", "kw"),
    [
        ("full", {}),
        ("euler", {"tail_steps": 3}),
        ("dpm-solver++", {}),
        ("dpm-solver++", {"tail_steps": 2}),
        ("dpm-solver++", {"tail_steps": 4, "tail_grid": "compressed"}),
        ("dpm-solver++", {"tail_steps": 50}),  # more than remain: every remaining step
    ],
)
@pytest.mark.parametrize("start", [0, 2, 4])
def test_counts_equal_forward_rows(tail: str, kw: dict[str, Any], start: int) -> None:
    steps = 8
    sampler = make(tail, steps=steps, start=start, **kw)
    policy = GaussianFlowPolicy()
    rollout = grow(sampler, policy, groups=2)
    remaining = steps - start - 2
    n_tail = remaining if kw.get("tail_steps") is None else min(kw["tail_steps"], remaining)
    expected = 2 * (start + (1 + 2) + 4 * n_tail)
    assert policy.forward_count == expected == sampler.rollout_forwards_at(start, 2)
    assert sampler.counts(2, 1).rollout_forwards == expected  # fixed window: exact
    assert rollout.stats["perf/rollout_forwards"] == expected
    assert rollout.stats["tree/tail_steps"] == n_tail
    assert int(rollout.node_step[rollout.sample_node].max()) == rollout.sigmas.shape[0] - 1
    assert float(rollout.sigmas[-1]) == 0.0
    rollout.validate()


def test_expected_and_worst_case_rows_with_a_capped_tail() -> None:
    """Geometric law: the expectation is the law-weighted mean of rollout_forwards_at, the worst case its maximum
    (with a cap, a late start can cost more rows than start 0)."""
    sampler = TreeSampler(num_steps=10, k=3, depth=3, tail="dpm-solver++", tail_steps=1)
    rows = [sampler.rollout_forwards_at(i, 4) for i in range(7)]
    probs = sampler.window_probs()
    assert sampler.expected_rollout_forwards(4) == pytest.approx(
        float(sum(p * r for p, r in zip(probs, rows, strict=True)))
    )
    assert sampler.counts(4, 1).rollout_forwards == max(rows) == rows[-1]
    paper = TreeSampler(num_steps=10, k=3, depth=3)
    assert paper.counts(4, 1).rollout_forwards == paper.rollout_forwards_at(0, 4)


@pytest.mark.parametrize(("tail", "kw"), [("euler", {"tail_steps": 2}), ("dpm-solver++", {"tail_steps": 3})])
def test_window_edges_do_not_depend_on_the_tail(tail: str, kw: dict[str, Any]) -> None:
    """Same seed, same window: trunk, window children and their old log-probs are those of the paper's full tail."""
    ref = grow(make("full", steps=10, start=3), GaussianFlowPolicy(), seed=5)
    got = grow(make(tail, steps=10, start=3, **kw), GaussianFlowPolicy(), seed=5)
    assert ref.trainable.nonzero().tolist() == got.trainable.nonzero().tolist()  # tails are appended after the window
    assert_fp32_close(got.old_log_probs[got.trainable], ref.old_log_probs[ref.trainable])
    upto = ref.node_step <= 5
    assert_fp32_close(got.states[: int(upto.sum())], ref.states[upto])
    assert got.stats["perf/rollout_forwards"] < ref.stats["perf/rollout_forwards"]


def test_full_tail_schedule_is_the_run_grid() -> None:
    """The paper preset's rollout sigmas are the run's grid itself (its trunk/tail edges unchanged)."""
    sampler = TreeSampler(num_steps=10, k=3, depth=3)
    grid = torch.linspace(1.0, 0.0, 11)
    for start in range(7):
        assert sampler.schedule(grid, start) is not None
        assert_fp32_close(sampler.schedule(grid, start), grid)
    short = TreeSampler(num_steps=10, k=3, depth=3, tail="euler", tail_steps=2)
    assert_fp32_close(short.schedule(grid, 1), torch.cat([grid[:5], grid[torch.tensor([7, 10])]]))


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"tail_steps": 3}, "sampler.init_args.tail"),
        ({"tail_grid": "compressed"}, "sampler.init_args.tail"),
        ({"tail": "dpm-solver++", "tail_steps": 0}, "sampler.init_args.tail_steps"),
        ({"tail": "dpm-solver++", "tail_grid": "compressed"}, "sampler.init_args.tail_steps"),
        ({"tail": "rk4"}, "sampler.init_args.tail:"),
        ({"tail": "euler", "tail_grid": "log"}, "sampler.init_args.tail_grid"),
        ({"tail": "euler", "tail_shift": -1.0}, "sampler.init_args.tail_shift"),
    ],
)
def test_bad_tail_settings_name_their_field(kw: dict[str, Any], field: str) -> None:
    problems = problems_of(TreeSampler, "sampler", **kw)
    assert any(p.startswith(field) for p in problems), problems
