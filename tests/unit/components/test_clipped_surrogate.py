"""The clipped-surrogate rule against a hand computation, and its parent-aligned minibatching."""

from __future__ import annotations

import math

import torch

from rlpost.api import Advantages, EdgeEval, UpdateContext
from rlpost.components.clipped_surrogate import ClippedSurrogate, parent_aligned_chunks
from rlpost.contract import Rollout


def test_parent_aligned_chunks_never_split_a_parent():
    parents = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3])
    chunks = parent_aligned_chunks(parents, 3)
    assert torch.cat(chunks).tolist() == list(range(10))
    for chunk in chunks:
        inside = set(parents[chunk].tolist())
        outside = set(parents[torch.tensor([i for i in range(10) if i not in chunk.tolist()])].tolist())
        assert not inside & outside
    single = parent_aligned_chunks(torch.tensor([5, 5]), 4)
    assert len(single) == 1 and single[0].tolist() == [0, 1]


class FixedSampler:
    """Returns given log-probs (as a differentiable function of one parameter) for the requested edges."""

    def __init__(self, theta: torch.nn.Parameter, new_logp: torch.Tensor) -> None:
        self.theta, self.new_logp = theta, new_logp

    def evaluate(self, policy, rollout, edges):
        lp = self.new_logp[edges] + 0 * self.theta
        return EdgeEval(log_prob=lp, mean=torch.zeros(len(edges), 1), std=torch.ones(len(edges), 1), forwards=1)


class RecordingBackend:
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.steps = 0

    def backward(self, loss):
        self.losses.append(float(loss))

    def step(self):
        self.steps += 1
        return {"train/grad_norm": 0.0, "train/lr": 1.0}

    world_size = 1


class NullPolicy:
    def train(self, mode=True):
        pass


def _rollout(old: torch.Tensor) -> Rollout:
    e = old.numel()
    return Rollout(
        prompts=["p"],
        metadata=[{}],
        sigmas=torch.tensor([1.0, 0.0]),
        states=torch.zeros(e + 1, 1),
        node_step=torch.zeros(e + 1, dtype=torch.long),
        node_group=torch.zeros(e + 1, dtype=torch.long),
        edge_parent=torch.zeros(e, dtype=torch.long),
        edge_child=torch.arange(1, e + 1),
        old_log_probs=old,
        trainable=torch.ones(e, dtype=torch.bool),
        edge_kernel=torch.zeros(e, dtype=torch.long),
        kernels=["flow-sde"],
        sample_node=torch.arange(1, e + 1),
        sample_group=torch.zeros(e, dtype=torch.long),
        images=torch.zeros(e, 1, 1, 3, dtype=torch.uint8),
    )


def test_loss_matches_hand_computation():
    old = torch.tensor([0.0, 0.0, 0.0])
    new = torch.tensor([math.log(1.5), math.log(0.5), math.log(1.05)])
    adv = torch.tensor([1.0, -2.0, 9.0])
    rule = ClippedSurrogate(clip_range=0.2, adv_clip_max=5.0)
    backend = RecordingBackend()
    theta = torch.nn.Parameter(torch.zeros(()))
    ctx = UpdateContext(
        NullPolicy(),
        FixedSampler(theta, new),
        _rollout(old),  # type: ignore[arg-type]
        Advantages(edges=adv, samples=adv),
        backend,
        torch.Generator().manual_seed(0),
        0,
    )
    metrics = rule.update(ctx)
    # Per edge: max(-A r, -A clip(r, 0.8, 1.2)) with A clipped to [-5, 5].
    expected = [max(-1 * 1.5, -1 * 1.2), max(2 * 0.5, 2 * 0.8), max(-5 * 1.05, -5 * 1.05)]
    assert backend.losses == [pytest_approx(sum(expected) / 3)]
    assert backend.steps == 1
    assert math.isclose(metrics["train/clipfrac"], 2 / 3, rel_tol=1e-6)
    assert math.isclose(metrics["train/ratio_max"], 1.5, rel_tol=1e-6)
    assert math.isclose(metrics["kl/approx"], 0.5 * float((new**2).mean()), rel_tol=1e-6)


def pytest_approx(x: float):
    import pytest

    return pytest.approx(x, rel=1e-6)


def test_optimizer_steps_split_edges_and_normalise_per_step():
    old = torch.zeros(4)
    rule = ClippedSurrogate(clip_range=10.0, optimizer_steps=2, minibatch_edges=1)
    backend = RecordingBackend()
    theta = torch.nn.Parameter(torch.zeros(()))
    rollout = _rollout(old)
    rollout.edge_parent = torch.tensor([0, 0, 1, 1])  # two parents with two children each
    rollout.node_step = torch.zeros(5, dtype=torch.long)
    ctx = UpdateContext(
        NullPolicy(),
        FixedSampler(theta, torch.zeros(4)),
        rollout,  # type: ignore[arg-type]
        Advantages(edges=torch.ones(4), samples=torch.ones(4)),
        backend,
        torch.Generator(),
        0,
    )
    rule.update(ctx)
    assert backend.steps == 2
    # minibatch_edges=1 cannot split a parent, so each optimizer step is one minibatch of 2 edges: loss -2/2.
    assert backend.losses == [-1.0, -1.0]
