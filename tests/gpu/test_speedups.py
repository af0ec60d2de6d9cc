"""``run.speedups`` speed-ups that need CUDA (marker ``gpu``; skipped cleanly without CUDA by tests/conftest.py):
CUDA graphs through torch.compile, the GPU attention kernels and bf16 autocast over fp32 weights, each on the tiny
builds with bf16 weights; the ratio guard passes them and still refuses a planted lossy speed-up.

Run on a GPU machine with ``HF_HUB_OFFLINE=1 .venv/bin/pytest -m gpu tests/gpu`` (benchmarks/device_check.sh does).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rlpost.apps.host import build_host
from rlpost.engine.ratio_guard import SpeedupRatioError
from rlpost.engine.recipe import parse_recipe, validate
from rlpost.engine.runner import Runner
from rlpost.models.acceleration import AccelerateConfig, Speedups

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
RECIPES = {"sd3": ROOT / "recipes/tiny/treegrpo.yaml", "flux": ROOT / "recipes/tiny/treegrpo_flux.yaml"}


@pytest.fixture(autouse=True)
def _fresh() -> Any:
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    before = _AttentionBackendRegistry._active_backend
    yield
    _AttentionBackendRegistry.set_active_backend(before)
    torch._dynamo.reset()


def _runner(tmp_path: Path, family: str, model_dir: Path, pairs: list[tuple[str, str]], dtype: str = "auto") -> Runner:
    host = build_host()
    base = [
        ("model.pretrained", str(model_dir)),
        ("model.dtype", dtype),
        ("run.device", "cuda"),
        ("run.output_dir", str(tmp_path / "run")),
        ("run.max_steps", "1"),
    ]
    return Runner(validate(parse_recipe([str(RECIPES[family])], base + pairs, host), host), host)


CASES: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "sd3-cuda-graphs": ("sd3", [("run.speedups.compile", "both"), ("run.speedups.cuda_graphs", "true")]),
    "sd3-compile-whole-model-rollout": (
        "sd3",
        [("run.speedups.compile", "rollout"), ("run.speedups.compile_regional", "false")],
    ),
    "sd3-sdpa-flash": ("sd3", [("run.speedups.attention_backend", "_native_flash")]),  # torch's sdpa_kernel
    "flux-sdpa-flash": ("flux", [("run.speedups.attention_backend", "_native_flash")]),  # diffusers' dispatcher
    "flux-sdpa-efficient": ("flux", [("run.speedups.attention_backend", "_native_efficient")]),
    "sd3-channels-last": ("sd3", [("run.speedups.vae_channels_last", "true")]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cuda_speedups_pass_the_guard_and_train(case: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    family, pairs = CASES[case]
    runner = _runner(tmp_path, family, request.getfixturevalue(f"tiny_{family}_dir"), pairs)
    metrics = runner.run()[0]
    assert runner.ratio_check is not None and runner.ratio_check.passed
    assert metrics["accelerate/ratio_error"] <= 1e-3
    assert all(v == v for k, v in metrics.items() if k.startswith(("reward/", "loss/")))  # finite: no NaN


def test_bf16_autocast_over_fp32_weights(tiny_sd3_dir: Path, tmp_path: Path) -> None:
    """Mixed precision (fp32 weights, bf16 autocast on both paths) keeps the ratio at 1."""
    runner = _runner(tmp_path, "sd3", tiny_sd3_dir, [("run.speedups.autocast", "bfloat16")], dtype="float32")
    runner.run()
    assert runner.ratio_check is not None and runner.ratio_check.max_error <= 1e-4


def test_guard_refuses_a_planted_lossy_speedup_on_cuda(
    tiny_sd3_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    honest = Speedups.call

    def lossy(self: Speedups, module: Any, *args: Any, **kwargs: Any) -> Any:
        out = honest(self, module, *args, **kwargs)
        return out if torch.is_grad_enabled() else tuple(o * 1.1 for o in out)

    monkeypatch.setattr(Speedups, "call", lossy)
    runner = _runner(tmp_path, "sd3", tiny_sd3_dir, [("run.speedups.attention_backend", "_native_flash")])
    with pytest.raises(SpeedupRatioError, match=r"run\.speedups: the speed-ups \['attention_backend=_native_flash"):
        runner.setup()


def test_cuda_graph_outputs_survive_the_next_replay(tiny_sd3_dir: Path) -> None:
    """A CUDA graph replays into the same memory: an earlier velocity must have been cloned out of it."""
    from rlpost.models.sd3 import SD3Policy

    policy = SD3Policy(str(tiny_sd3_dir), resolution=32, guidance_scale=4.5, max_sequence_length=32)
    policy.setup(torch.device("cuda"))
    policy.accelerate(AccelerateConfig(compile="rollout", cuda_graphs=True))
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = policy.initial_noise(2, gen)
    cond, sigmas = policy.encode(["a cat", "a dog"]), policy.sigmas(4)
    with torch.no_grad():
        for _ in range(3):  # warm-up and recording
            policy.velocity(x, sigmas[1].expand(2), cond)
        first = policy.velocity(x, sigmas[1].expand(2), cond)
        kept = first.clone()
        policy.velocity(x * 0.5, sigmas[2].expand(2), cond)
    torch.testing.assert_close(first, kept, rtol=0, atol=0)
