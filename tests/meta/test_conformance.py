"""Every component a first-party plugin registers passes the conformance kit (``rlpost.testing``), on the tiny
real-architecture models and tiny random reward checkpoints loaded through the production paths.

``CASES`` says how to build each registered component for the kit (test init args; reward models get tiny
checkpoints in their released formats, ``tests/plugins/rewards/checkpoints.py``) and what to check it with. A
component registered by distribution ``rlpost`` that has no case fails ``test_every_first_party_component_has_a_case``,
so a new component cannot skip conformance. That each check can fail: ``tests/unit/testing/test_checks.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rlpost.apps.host import build_host
from rlpost.core.plugins import PluginHost
from rlpost.testing import (
    check_advantage_estimator,
    check_policy,
    check_prompt_source,
    check_reward_source,
    check_sampler,
    check_update_rule,
    sample_rollout,
)

KINDS = ("sampler", "advantage", "reward", "optimizer", "model", "prompts")

# Small settings for every sampler (the tiny recipes' shapes); estimators and update rules run on their rollouts.
SAMPLERS: dict[str, dict[str, Any]] = {
    "tree": {
        "num_steps": 4,
        "k": 2,
        "depth": 2,
        "window": "geometric",
        "ratio": 0.5,
        "kernel": "flow-sde",
        "kernel_args": {"noise_level": 0.7},
    },
    "dance": {"num_steps": 4, "eta": 0.3, "timestep_fraction": 1.0},
    "mix": {
        "num_steps": 6,
        "noise_level": 0.7,
        "window_size": 2,
        "shift_interval": 1,
        "window_strategy": "progressive",
        "roll_back": True,
        "dpm_after_window": True,
        "compress_ratio": 0.5,
    },
    "ddpo": {"num_steps": 4, "noise_level": 0.7, "timestep_fraction": 1.0},
    "solver": {"num_steps": 4, "solver": "sde-band", "noise_level": 0.7},
    "tempflow": {"num_steps": 4, "k": 2, "kernel": "flow-sde", "kernel_args": {"noise_level": 0.7}},
    "branch": {"num_steps": 4, "split_points": [0, 1], "eta": 0.3, "split_noise_scale": 4.0},
    "flow-grpo": {"num_steps": 4, "kernel": "sde", "noise_level": 0.7, "record_old_means": True},
}


@dataclass(frozen=True)
class Case:
    """How to check one registered component.

    Attributes:
        kind: Registry kind.
        name: Registered name.
        run: ``run(cls, env)`` builds the component from its class and checks it.
        variant: Tells several cases of one component apart.
    """

    kind: str
    name: str
    run: Callable[[type, Env], Any]
    variant: str = ""

    @property
    def id(self) -> str:
        return f"{self.kind}:{self.name}" + (f"[{self.variant}]" if self.variant else "")


@dataclass
class Env:
    """What cases may use: the plugin host, the tiny SD3 policy, and lazily built fixtures."""

    host: PluginHost
    request: pytest.FixtureRequest

    @property
    def policy(self) -> Any:
        return self.request.getfixturevalue("rlpost_tiny_policy")

    def fixture(self, name: str) -> Any:
        return self.request.getfixturevalue(name)

    def sampler(self, name: str) -> Any:
        return self.host.registry("sampler").get(name).cls(**SAMPLERS[name])


def _sampler(name: str) -> Case:
    return Case("sampler", name, lambda cls, env: check_sampler(cls(**SAMPLERS[name]), env.policy))


def _estimator(name: str, sampler: str, **init: Any) -> Case:
    def run(cls: type, env: Env) -> Any:
        rollout = sample_rollout(env.sampler(sampler), env.policy, groups=2, samples_per_group=3)
        return check_advantage_estimator(cls(**init), rollout)

    return Case("advantage", name, run)


def _rule(name: str, sampler: str, variant: str, **init: Any) -> Case:
    return Case(
        "optimizer", name, lambda cls, env: check_update_rule(cls(**init), env.policy, env.sampler(sampler)), variant
    )


def _reward(name: str, init: Callable[[Env], dict[str, Any]], **check: Any) -> Case:
    return Case("reward", name, lambda cls, env: check_reward_source(cls(**init(env)), **check))


def _model(name: str, fixture: str) -> Case:
    return Case("model", name, lambda cls, env: check_policy(env.fixture(fixture)))


def _tiny_model(name: str, **settings: Any) -> Case:
    """The registered class itself on its ``tiny-random`` build (real architecture, random weights, loaded through
    ``from_pretrained``), with a rank-4 LoRA, set up on CPU in fp32."""

    def run(cls: type, env: Env) -> Any:
        import torch

        from rlpost import LoraSpec

        policy = cls("tiny-random", dtype="float32", max_sequence_length=32, lora=LoraSpec(rank=4, alpha=8), **settings)
        policy.setup(torch.device("cpu"))
        return check_policy(policy)

    return Case("model", name, run)


def _prompts(name: str, init: Callable[[Path], dict[str, Any]]) -> Case:
    return Case("prompts", name, lambda cls, env: check_prompt_source(cls(**init(env.fixture("prompt_files")))))


DIGITS = {"metadata": [{"digit": d} for d in (3, 7, 0, 9)]}

CASES: tuple[Case, ...] = (
    *(_sampler(name) for name in SAMPLERS),
    _estimator("tree-backup", "tree"),
    _estimator("leaf-zscore", "tree"),
    _estimator("group-zscore", "dance", eps=1e-8),
    _estimator("branch-fusion", "branch"),
    _estimator("per-prompt", "ddpo", buffer_size=4, min_count=2),
    _estimator("tempflow", "tempflow"),
    _estimator("flow-grpo", "flow-grpo", global_std=False),
    _rule("flow-grpo", "flow-grpo", "kl-two-steps", kl_coef=0.01, optimizer_steps=2, minibatch_edges=4),
    _rule("flow-grpo", "flow-grpo", "grpo-guard", optimizer_steps=2, ratio_norm=True, minibatch_edges=4),
    _rule("clipped-surrogate", "tree", "tree-one-step", clip_range=1e-4, optimizer_steps=1, minibatch_edges=6),
    _rule(
        "clipped-surrogate",
        "dance",
        "chains-kl-two-epochs",
        kl_coef=0.1,
        inner_epochs=2,
        optimizer_steps=2,
        accumulation_unit="sample",
        shuffle=False,
        minibatch_edges=3,
    ),
    _rule("tempflow", "tempflow", "comb-one-step", kl_coef=0.0, optimizer_steps=1, minibatch_edges=6),
    _rule("tempflow", "tempflow", "comb-kl-two-steps", kl_coef=0.1, optimizer_steps=2, minibatch_edges=2),
    _rule("branch-surrogate", "branch", "branch-one-step", clip_range=1e-4, optimizer_steps=1, minibatch_edges=6),
    # The likelihood-free rules on the solver sampler's rollouts (clean samples, no trainable edge).
    _rule("nft", "solver", "solver", kl_beta=1e-4, minibatch_samples=3),
    # TreeNFT: the NFT loss at the tree sampler's window nodes (the rollout under the old copy, or the live weights
    # with NFT's fresh rows added).
    _rule("tree-nft", "tree", "tree-window", kl_beta=1e-4, minibatch_rows=2),
    _rule("tree-nft", "tree", "tree-live-fresh-rows", kl_beta=0.0, rollout_policy="live", fresh_rows=2),
    _rule("awm", "solver", "solver", num_train_timesteps=2, time_type="discrete", minibatch_samples=3),
    _rule("dgpo", "solver", "solver", num_train_timesteps=2, trunc_steps=2),
    _reward("jpeg-compressibility", lambda env: {}),
    _reward("jpeg-incompressibility", lambda env: {}),
    _reward("digits-brightness", lambda env: {}),
    _reward("digit-alignment", lambda env: {}, **DIGITS),
    _reward("digit-judge", lambda env: {}, **DIGITS),
    _reward("hps-v2.1", lambda env: env.fixture("reward_weights")["hps"]),
    _reward("clipscore", lambda env: env.fixture("reward_weights")["clipscore"]),
    _reward("aesthetic", lambda env: env.fixture("reward_weights")["aesthetic"]),
    _reward("pickscore", lambda env: env.fixture("reward_weights")["pickscore"]),
    _reward("image-reward", lambda env: env.fixture("reward_weights")["image-reward"]),
    _reward("remote", lambda env: {"url": env.fixture("reward_server"), "expect_reward": "jpeg-compressibility"}),
    _model("sd3", "rlpost_tiny_policy"),
    _model("flux", "rlpost_tiny_flux_policy"),
    _tiny_model("wan", height=32, width=48, num_frames=9),  # 9 frames: the check covers decode's frame axis
    _tiny_model("qwen-image", resolution=32),
    _prompts("prompt-list", lambda tmp: {"prompts": ["a red cube", "two cats"], "metadata": [{"k": 1}, {}]}),
    _prompts("prompt-file", lambda tmp: {"path": str(tmp / "prompts.txt")}),
    _prompts("hf-dataset", lambda tmp: {"path": "json", "data_files": str(tmp / "prompts.jsonl")}),
    _prompts("digit-prompts", lambda tmp: {"split": "eval"}),
)


# ---------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def host() -> PluginHost:
    return build_host()


@pytest.fixture(scope="module")
def prompt_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("prompt_files")
    (root / "prompts.txt").write_text("a red cube\na blue sphere\n")
    (root / "prompts.jsonl").write_text('{"prompt": "a red cube", "style": "photo"}\n{"prompt": "a cat"}\n')
    return root


@pytest.fixture(scope="module")
def reward_weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Init args of each weight-loading reward, pointing at tiny random checkpoints in the released formats."""
    import torch
    from safetensors.torch import save_file

    from tests.plugins.rewards import checkpoints

    root = tmp_path_factory.mktemp("reward_weights")
    clip = checkpoints.register_tiny_open_clip(root / "open_clip_cfg")
    state = checkpoints.tiny_open_clip_state(clip)
    torch.save({"state_dict": state}, root / "hps.pt")
    save_file({k: v.contiguous() for k, v in state.items()}, str(root / "clip.safetensors"))
    model_dir, tok_dir, _ = checkpoints.write_pickscore_dirs(root / "pickscore")
    clip_dir, head = checkpoints.write_aesthetic_files(root / "aesthetic")
    ir = checkpoints.write_imagereward_files(root)
    return {
        "hps": {"checkpoint": str(root / "hps.pt"), "model_name": clip},
        "clipscore": {"pretrained": str(root / "clip.safetensors"), "model_name": clip},
        "pickscore": {"model_dir": str(model_dir), "tokenizer_dir": str(tok_dir)},
        "aesthetic": {"clip_dir": str(clip_dir), "head": str(head)},
        "image-reward": {
            "checkpoint": str(ir["ckpt"]),
            "med_config": str(ir["ckpt"].parent / "med_config.json"),
            "tokenizer_dir": str(ir["tok"]),
        },
    }


@pytest.fixture(scope="module")
def reward_server() -> Iterator[str]:
    """A reward server on 127.0.0.1 (a free port) scoring JPEG compressibility, in a thread."""
    import torch

    from rlpost_rewards.jpeg import JpegCompressibility
    from rlpost_rewards.server import make_server

    reward = JpegCompressibility()
    reward.setup(torch.device("cpu"))
    server = make_server(reward, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        address, port = server.server_address[:2]
        yield f"http://{address}:{port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


# ------------------------------------------------------------------------------------------------------- tests


def _first_party(host: PluginHost) -> set[tuple[str, str]]:
    found = set()
    for kind in KINDS:
        registry = host.registry(kind)
        found |= {(kind, name) for name in registry.names() if registry.get(name).distribution == "rlpost"}
    return found


def test_every_first_party_component_has_a_case(host):
    registered = _first_party(host)
    covered = {(c.kind, c.name) for c in CASES}
    assert len(registered) >= 25, sorted(registered)  # the first-party plugins loaded (an empty set passes nothing)
    assert registered - covered == set(), (
        f"first-party components without a conformance case: {sorted(registered - covered)}"
    )
    assert covered - registered == set(), (
        f"cases for components no first-party plugin registers: {sorted(covered - registered)}"
    )


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_first_party_component_conforms(case: Case, host: PluginHost, request: pytest.FixtureRequest) -> None:
    entry = host.registry(case.kind).get(case.name)
    assert entry.distribution == "rlpost"
    case.run(entry.cls, Env(host, request))
