"""The clipped-surrogate rule against a hand computation, and its parent-aligned minibatching."""

from __future__ import annotations

import math

import pytest
import torch

from rlpost.components.clipped_surrogate import ClippedSurrogate, parent_aligned_chunks
from rlpost.core.api import Advantages, EdgeEval, UpdateContext
from rlpost.core.contract import Rollout
from tests.argument_checks import problems_of


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
        media=torch.zeros(e, 1, 1, 1, 3, dtype=torch.uint8),
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
    metrics = rule.update(ctx).metrics
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


# --------------------------------------------------------------------------------------- optimizer-step layout


class LinearSampler:
    """``log π_θ(e) = old_e + θ · feature_e``: the ratio is exactly 1 while θ is at 0, and leaves 1 once θ moves.

    Records which edges each evaluation asked for, so tests can read the minibatch/step composition.
    """

    def __init__(self, theta: torch.nn.Parameter, old: torch.Tensor, feature: torch.Tensor) -> None:
        self.theta, self.old, self.feature = theta, old, feature
        self.calls: list[list[int]] = []

    def evaluate(self, policy, rollout, edges):
        self.calls.append(edges.tolist())
        lp = self.old[edges].double() + self.theta.double() * self.feature[edges].double()
        n = len(edges)
        forwards = len(set(rollout.edge_parent[edges].tolist()))  # one forward per parent, as a real sampler
        return EdgeEval(log_prob=lp, mean=torch.zeros(n, 1), std=torch.ones(n, 1), forwards=forwards)


class StepRecorder(RecordingBackend):
    """Records the losses of every optimizer step separately (and the edges the sampler evaluated in it)."""

    def __init__(self, sampler: LinearSampler | None = None, world_size: int = 1) -> None:
        super().__init__()
        self.sampler = sampler
        self.step_losses: list[list[float]] = [[]]
        self.step_edges: list[list[int]] = []
        self.world_size = world_size  # type: ignore[misc]

    def backward(self, loss):
        super().backward(loss)
        self.step_losses[-1].append(float(loss))

    def step(self):
        if self.sampler is not None:
            self.step_edges.append(sorted(e for call in self.sampler.calls for e in call))
            self.sampler.calls = []
        self.step_losses.append([])
        return super().step()


def _tree_like(parents: list[int], old: torch.Tensor | None = None) -> Rollout:
    """A rollout whose trainable edges have the given parents (node ids < number of edges + 1)."""
    rollout = _rollout(torch.zeros(len(parents)) if old is None else old)
    rollout.edge_parent = torch.tensor(parents)
    return rollout


def _ctx(rollout, sampler, backend, adv, seed: int = 0) -> UpdateContext:
    return UpdateContext(
        NullPolicy(),  # type: ignore[arg-type]
        sampler,
        rollout,
        Advantages(edges=adv, samples=adv),
        backend,
        torch.Generator().manual_seed(seed),
        0,
    )


def _sgd_update(rule: ClippedSurrogate, edges: int, lr: float) -> tuple[dict[str, float], torch.nn.Parameter]:
    """One update of ``rule`` on ``edges`` single-child parents with A = +1, through the real LocalBackend + SGD."""
    from rlpost.engine.backend import LocalBackend

    theta = torch.nn.Parameter(torch.zeros(()))
    old = torch.zeros(edges)
    sampler = LinearSampler(theta, old, torch.ones(edges))
    backend = LocalBackend([theta], torch.optim.SGD([theta], lr=lr), max_grad_norm=None)
    rollout = _tree_like(list(range(edges)), old)
    metrics = rule.update(_ctx(rollout, sampler, backend, torch.ones(edges))).metrics
    return metrics, theta


def test_several_optimizer_steps_move_the_ratio_and_the_clip_binds():
    metrics, theta = _sgd_update(ClippedSurrogate(clip_range=1e-4, optimizer_steps=2, minibatch_edges=2), 4, lr=1.0)
    assert metrics["train/optimizer_steps"] == 2
    # Step 1 sees ratio 1 (θ = 0) and moves θ by lr·mean(feature·ratio·A) = 1; step 2 sees ratio e > 1 + ε: clipped,
    # so step 2's gradient is zero and θ stays at 1.
    assert float(theta) == pytest_approx(1.0)
    assert metrics["train/first_ratio_dev"] == 0.0
    assert metrics["train/clipfrac_after_first"] == 1.0
    assert metrics["train/clipfrac"] == 0.5
    assert metrics["train/ratio_max"] == pytest_approx(math.e)
    assert metrics["train/ratio_min"] == 1.0
    assert metrics["train/ratio_std"] == pytest_approx((math.e - 1) / 2)


def test_one_optimizer_step_keeps_the_ratio_exactly_one():
    # Every minibatch of the single step is evaluated before the weights move: ratio exactly 1 (bitwise), plain
    # policy gradient, and no after-first statistics (there is no later step).
    metrics, theta = _sgd_update(ClippedSurrogate(clip_range=1e-4, optimizer_steps=1, minibatch_edges=1), 4, lr=1.0)
    assert metrics["train/optimizer_steps"] == 1
    assert metrics["train/ratio_min"] == metrics["train/ratio_max"] == 1.0
    assert metrics["train/ratio_std"] == 0.0 and metrics["train/clipfrac"] == 0.0
    assert "train/clipfrac_after_first" not in metrics
    assert float(theta) == pytest_approx(1.0)
    # Unset optimizer_steps and units_per_step also means one step.
    default, _ = _sgd_update(ClippedSurrogate(minibatch_edges=1), 4, lr=1.0)
    assert default["train/optimizer_steps"] == 1 and default["train/ratio_max"] == 1.0


def test_uneven_parent_aligned_steps_keep_parents_whole_and_count_as_configured():
    # 7 parents with 1-3 children each (13 edges), 3 optimizer steps: 7 parents do not divide by 3.
    parents = [0, 0, 0, 1, 2, 2, 3, 4, 4, 4, 5, 6, 6]
    theta = torch.nn.Parameter(torch.zeros(()))
    sampler = LinearSampler(theta, torch.zeros(13), torch.zeros(13))
    backend = StepRecorder(sampler)
    rule = ClippedSurrogate(optimizer_steps=3, minibatch_edges=2, inner_epochs=2)
    result = rule.update(_ctx(_tree_like(parents), sampler, backend, torch.ones(13), seed=3))
    assert backend.steps == 6 and result.metrics["train/optimizer_steps"] == 6  # 3 per pass, 2 passes
    for epoch in (backend.step_edges[:3], backend.step_edges[3:]):
        assert sorted(e for step in epoch for e in step) == list(range(13))  # every edge once per pass
        step_parents = [{parents[e] for e in step} for step in epoch]
        assert sorted(len(p) for p in step_parents) == [2, 2, 3]  # near-equal parent counts
        for i, ps in enumerate(step_parents):  # a parent's children never straddle two steps
            for other in step_parents[i + 1 :]:
                assert not ps & other
            assert all(all(parents[e] in ps for e in range(13) if parents[e] == p) for p in ps)
    # Each parent's children are evaluated in one call (one forward per parent), even with minibatch_edges=2.
    assert result.train_forwards == 14 and result.trained_edges == 13 and result.reference_forwards == 0


def test_units_per_step_counts_units_over_all_ranks():
    parents = list(range(7))
    for world, units_per_step, expected in ((1, 3, 3), (1, 7, 1), (2, 3, 5), (2, 14, 1)):
        theta = torch.nn.Parameter(torch.zeros(()))
        sampler = LinearSampler(theta, torch.zeros(7), torch.zeros(7))
        backend = StepRecorder(sampler, world_size=world)
        rule = ClippedSurrogate(units_per_step=units_per_step)
        metrics = rule.update(_ctx(_tree_like(parents), sampler, backend, torch.ones(7))).metrics
        assert metrics["train/optimizer_steps"] == expected, (world, units_per_step)
        assert max(len(s) for s in backend.step_edges) - min(len(s) for s in backend.step_edges) <= 1


def test_more_steps_than_units_is_an_error_naming_the_field():
    theta = torch.nn.Parameter(torch.zeros(()))
    sampler = LinearSampler(theta, torch.zeros(4), torch.zeros(4))
    rule = ClippedSurrogate(optimizer_steps=3)
    with pytest.raises(ValueError, match=r"optimizer\.init_args\.optimizer_steps: 3 optimizer steps .* only 2 parent"):
        rule.update(_ctx(_tree_like([0, 0, 1, 1]), sampler, StepRecorder(sampler), torch.ones(4)))


def test_loss_normalisation_per_optimizer_step_matches_hand_computation():
    # Parents 0 (3 children), 1 (1 child), 2 (2 children); 2 steps, units in rollout order (no shuffle):
    # step 1 = parents {0, 1} (4 edges), step 2 = parent {2} (2 edges). Ratio 1 in step 1 (θ = 0); θ never moves
    # (the recording backend does not step), so every per-edge loss is -A_e.
    parents = [0, 0, 0, 1, 2, 2]
    adv = torch.tensor([1.0, 2.0, -1.0, 7.0, 0.5, -3.0])  # 7 is clipped to adv_clip_max 5
    clipped = adv.clamp(-5, 5)
    for norm, denoms in (("edge", (4, 2)), ("parent", (2, 1))):
        theta = torch.nn.Parameter(torch.zeros(()))
        sampler = LinearSampler(theta, torch.zeros(6), torch.zeros(6))
        backend = StepRecorder(sampler)
        rule = ClippedSurrogate(optimizer_steps=2, shuffle=False, loss_normalisation=norm, minibatch_edges=1)
        metrics = rule.update(_ctx(_tree_like(parents), sampler, backend, adv)).metrics
        assert backend.step_edges == [[0, 1, 2, 3], [4, 5]]
        # minibatch_edges=1 cannot split a parent: minibatches are parent 0, parent 1, parent 2.
        assert backend.step_losses[0] == [
            pytest_approx(-float(clipped[:3].sum()) / denoms[0]),
            pytest_approx(-float(clipped[3]) / denoms[0]),
        ]
        assert backend.step_losses[1] == [pytest_approx(-float(clipped[4:].sum()) / denoms[1])]
        # loss/policy is the per-edge mean of each minibatch, whatever the normalisation.
        per_mb = [-float(clipped[:3].mean()), -float(clipped[3]), -float(clipped[4:].mean())]
        assert metrics["loss/policy"] == pytest_approx(sum(per_mb) / 3)


def test_sample_units_keep_a_chains_edges_in_one_step_in_rollout_order():
    from tests.unit.components.chain_helpers import chain_rollout

    rollout = chain_rollout(2, 3, 4, torch.tensor([[True, False, True, True]] * 6))  # 6 chains, 3 trained edges
    from rlpost.components.chain import edge_sample_ids

    owner = edge_sample_ids(rollout)
    e = rollout.num_edges
    theta = torch.nn.Parameter(torch.zeros(()))
    sampler = LinearSampler(theta, torch.zeros(e), torch.zeros(e))
    backend = StepRecorder(sampler)
    rule = ClippedSurrogate(accumulation_unit="sample", optimizer_steps=3, shuffle=False, minibatch_edges=4)
    metrics = rule.update(_ctx(rollout, sampler, backend, torch.ones(e))).metrics
    assert metrics["train/optimizer_steps"] == 3
    samples_per_step = [sorted({int(owner[x]) for x in step}) for step in backend.step_edges]
    assert samples_per_step == [[0, 1], [2, 3], [4, 5]]  # DanceGRPO/MixGRPO order: samples in rollout order
    assert all(len(step) == 6 for step in backend.step_edges)  # 2 samples x 3 trained edges
    # Shuffled: still whole samples per step, in another order.
    backend = StepRecorder(sampler)
    rule = ClippedSurrogate(accumulation_unit="sample", optimizer_steps=3, shuffle=True, minibatch_edges=4)
    rule.update(_ctx(rollout, sampler, backend, torch.ones(e), seed=1))
    shuffled = [sorted({int(owner[x]) for x in step}) for step in backend.step_edges]
    assert all(len(s) == 2 for s in shuffled) and sorted(x for s in shuffled for x in s) == list(range(6))
    assert shuffled != samples_per_step


def test_sample_units_on_a_tree_are_an_error_naming_the_field():
    theta = torch.nn.Parameter(torch.zeros(()))
    sampler = LinearSampler(theta, torch.zeros(4), torch.zeros(4))
    rule = ClippedSurrogate(accumulation_unit="sample")
    with pytest.raises(ValueError, match=r"optimizer\.init_args\.accumulation_unit: 'sample' needs chain rollouts"):
        rule.update(_ctx(_tree_like([0, 0, 1, 1]), sampler, StepRecorder(sampler), torch.ones(4)))


class _Counts:
    def __init__(self, images: int, edges: int, forwards: int) -> None:
        from rlpost.core.api import StepCounts

        self.c = StepCounts(images=images, trainable_edges=edges, rollout_forwards=0, train_forwards=forwards)

    def counts(self):
        return self.c


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"optimizer_steps": 0}, "optimizer.init_args.optimizer_steps: must be >= 1, got 0"),
        ({"units_per_step": -2}, "optimizer.init_args.units_per_step: must be >= 1, got -2"),
        ({"optimizer_steps": 1.5}, "optimizer.init_args.optimizer_steps: must be an integer >= 1 or null, got 1.5"),
        ({"inner_epochs": 0}, "optimizer.init_args.inner_epochs: must be >= 1, got 0"),
        ({"clip_range": 0.0}, "optimizer.init_args.clip_range: must be > 0, got 0.0"),
        ({"kl_coef": float("nan")}, "optimizer.init_args.kl_coef: must be a finite number >= 0, got nan"),
        ({"minibatch_edges": None}, "optimizer.init_args.minibatch_edges: must be an integer >= 1, got None"),
        ({"optimizer_steps": 2, "units_per_step": 4}, "optimizer.init_args.units_per_step: set either"),
        ({"accumulation_unit": "edge"}, "optimizer.init_args.accumulation_unit: must be one of ['parent', 'sample']"),
        ({"loss_normalisation": "sum"}, "optimizer.init_args.loss_normalisation: must be one of ['edge', 'parent']"),
        ({"shuffle": "yes"}, "optimizer.init_args.shuffle: must be true or false, got 'yes'"),
        ({"optimizer_steps": 13}, "optimizer.init_args.optimizer_steps: 13 optimizer steps per pass but only 12"),
        ({"units_per_step": 0}, "optimizer.init_args.units_per_step: must be >= 1, got 0"),
        ({"accumulation_unit": "sample", "optimizer_steps": 2}, "'sample' needs chain rollouts"),
    ],
)
def test_validate_rejects_nonsense_naming_the_field(kwargs, message):
    tree = _Counts(images=36, edges=36, forwards=12)  # 12 parents with 3 trained children each
    problems = problems_of(ClippedSurrogate, "optimizer", tree, **kwargs)
    assert any(message in p for p in problems), problems


def test_validate_accepts_upstream_layouts():
    chains = _Counts(images=48, edges=240, forwards=240)  # 48 chains x 5 trained steps
    tree = _Counts(images=108, edges=156, forwards=52)
    assert ClippedSurrogate(optimizer_steps=3, accumulation_unit="sample", shuffle=False).validate(chains) == []
    assert ClippedSurrogate(units_per_step=16, accumulation_unit="sample").validate(chains) == []
    assert ClippedSurrogate(optimizer_steps=2, loss_normalisation="parent").validate(tree) == []
    assert ClippedSurrogate(optimizer_steps=5).validate(tree) == []  # 52 parents need not divide by 5


def test_reference_forwards_are_declared_only_with_a_kl_term():
    """Cost models read this to count the KL reference's no-grad forwards (the tiny bench checks it against the
    forwards actually run, tests/unit/test_bench.py)."""
    assert ClippedSurrogate().reference_forwards_per_train_forward() == 0
    assert ClippedSurrogate(kl_coef=0.1).reference_forwards_per_train_forward() == 1
