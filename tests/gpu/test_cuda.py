"""GPU-only checks (marker ``gpu``; skipped cleanly without CUDA by tests/conftest.py).

Run on a GPU machine with ``HF_HUB_OFFLINE=1 .venv/bin/pytest -m gpu`` (or ``tox -e gpu``).
"""

from __future__ import annotations

import pytest
import torch

from rlpost.models.flux import FluxPolicy
from rlpost.models.sd3 import LoraSpec, SD3Policy
from rlpost.ops.kernels import make_kernel

pytestmark = pytest.mark.gpu

# family -> (policy class, tiny model fixture, guidance scale, tiny TreeGRPO recipe)
FAMILIES = {
    "sd3": (SD3Policy, "tiny_sd3_dir", 4.5, "recipes/tiny/treegrpo.yaml"),
    "flux": (FluxPolicy, "tiny_flux_dir", 3.5, "recipes/tiny/treegrpo_flux.yaml"),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_weights_give_fp32_velocity_and_ratio_one(family, request):
    """bf16 weights on CUDA with fp32 log-prob math: recomputing a stored step gives an importance ratio of 1."""
    cls, fixture, guidance, _ = FAMILIES[family]
    model_dir = request.getfixturevalue(fixture)
    policy = cls(pretrained=str(model_dir), resolution=32, guidance_scale=guidance, lora=LoraSpec(rank=4, alpha=4))
    policy.setup(torch.device("cuda"))
    assert policy.weight_dtype == torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = policy.initial_noise(4, gen)
    cond = policy.encode(["a cat"] * 4)
    sigmas = policy.sigmas(10)
    sigma, sigma_next = sigmas[2].expand(4), sigmas[3].expand(4)
    kernel = make_kernel("flow-sde", noise_level=0.7)
    with torch.no_grad():
        v = policy.velocity(x, sigma, cond)
        out = kernel.step(x, v, sigma, sigma_next, gen)
    assert v.dtype == torch.float32
    v2 = policy.velocity(x, sigma, cond)
    mean, std = kernel.mean_std(x, v2, sigma, sigma_next)
    ratio = torch.exp(kernel.log_prob(out.next_latents, mean, std) - out.log_prob)
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tiny_tree_training_step_on_cuda(family, request, tmp_path, monkeypatch):
    """Two TreeGRPO iterations of the tiny recipe on CUDA (bf16 weights) run and keep metrics finite."""
    import json
    from pathlib import Path

    from rlpost.apps import cli

    _, fixture, _, recipe = FAMILIES[family]
    model_dir = request.getfixturevalue(fixture)
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    out = tmp_path / "run"
    rc = cli.main(
        [
            "train",
            "--recipe",
            recipe,
            "--model.pretrained",
            str(model_dir),
            "--model.dtype",
            "auto",
            "--run.device",
            "cuda",
            "--run.output_dir",
            str(out),
            "--run.max_steps",
            "2",
        ]
    )
    assert rc == 0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2
    assert lines[0]["train/first_ratio_dev"] <= 1e-4
