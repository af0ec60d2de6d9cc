"""What ``rlpost bench`` reads from the components is declared in their interfaces (rlpost/core/api/), and the bench
package reads nothing else: no module over ~300 lines, no attribute probing, no method replaced on a live object."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from rlpost.components.clipped_surrogate import ClippedSurrogate
from rlpost.core.api import Policy, PolicyOptimizer, Sampler
from rlpost_treegrpo.sampler import TreeSampler
from tests.toy_components import ToyChainSampler

BENCH = Path(__file__).resolve().parents[2] / "rlpost" / "bench"


def test_bench_package_modules_are_small_and_probe_nothing() -> None:
    modules = sorted(BENCH.glob("*.py"))
    assert {p.name for p in modules} >= {"__init__.py", "spec.py", "driver.py", "costmodel.py", "report.py", "stats.py"}
    assert not (BENCH.parent / "bench.py").exists() and not (BENCH.parent / "bench_stats.py").exists()
    for path in modules:
        text = path.read_text()
        assert len(text.splitlines()) <= 300, f"{path.name}: {len(text.splitlines())} lines"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in ("getattr", "hasattr", "setattr", "delattr"), f"{path.name}:{node.lineno}"


def test_sampler_counts_default_to_the_closed_form() -> None:
    sampler = ToyChainSampler(num_steps=3)
    assert sampler.step_counts(2, 4) == sampler.counts(2, 4)
    assert sampler.expected_rollout_forwards(2, 4) == float(sampler.counts(2, 4).rollout_forwards) == 24.0
    assert sampler.chunk_size == Sampler.chunk_size == 0  # no declared budget: the whole frontier per forward


def test_tree_step_counts_follow_the_drawn_window() -> None:
    sampler = TreeSampler(num_steps=6, k=2, depth=2, window="uniform", chunk_size=5)
    worst = sampler.counts(3, 1)
    assert sampler.step_counts(3, 1) == worst  # before any step: the worst case
    starts = set()
    for step in range(40):
        sampler.begin_step(step, torch.Generator().manual_seed(step))
        assert sampler.window_start is not None
        starts.add(sampler.window_start)
        drawn = sampler.step_counts(3, 1)
        assert drawn.rollout_forwards == sampler.rollout_forwards_at(sampler.window_start, 3)
        assert (drawn.images, drawn.trainable_edges, drawn.train_forwards) == (
            worst.images,
            worst.trainable_edges,
            worst.train_forwards,
        )
    assert len(starts) > 1, "the uniform law moves the window"
    assert sampler.chunk_size == 5


def test_optimizer_and_policy_declare_what_cost_models_read() -> None:
    rule = ClippedSurrogate(inner_epochs=2, minibatch_edges=16)
    assert (rule.inner_epochs, rule.minibatch_edges) == (2, 16)
    assert (PolicyOptimizer.inner_epochs, PolicyOptimizer.minibatch_edges) == (1, 0)
    assert Policy.forward_count == 0 and "forward_count" in Policy.__dict__
