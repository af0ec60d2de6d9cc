"""``run.speedups`` on the model side (rlpost/models/acceleration.py): settings checks naming their fields, which path
each call takes, where each speed-up hooks into a diffusers policy, and that LoRA survives in-place compilation.

Equality of whole rollouts with and without each speed-up, and the ratio guard, are tests/unit/test_ratio_guard.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from rlpost.apps.host import build_host
from rlpost.engine.recipe import RecipeError, parse_recipe, validate
from rlpost.models import LoraSpec
from rlpost.models.acceleration import (
    Accelerable,
    AccelerateConfig,
    Speedups,
    acceleration_problems,
    apply_acceleration,
    attention_backend_names,
    repeated_blocks,
)
from tests.models_fixtures_wan import *  # noqa: F403  (the fixtures tiny_wan_dir, make_wan_policy)
from tests.tolerances import assert_fp32_close

TINY_TREE = "recipes/tiny/treegrpo.yaml"
KERNEL_ATOL = 1e-5
"""Another attention kernel for the same fp32 velocity (SDPA math vs the CPU flash kernel): measured 1.4e-6 on the
tiny SD3; docs/speed.md states this bound."""


@pytest.fixture(autouse=True)
def _restore_attention_backend() -> Iterator[None]:
    """diffusers' ``set_attention_backend`` also sets the process's active backend; give it back after each test."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    before = _AttentionBackendRegistry._active_backend
    yield
    _AttentionBackendRegistry.set_active_backend(before)


# ------------------------------------------------------------------------------------------------ settings


def test_defaults_are_off_and_valid() -> None:
    settings = AccelerateConfig()
    assert settings.enabled() == [] and settings.problems("cpu") == []
    assert settings.ratio_tolerance == 1e-3 and settings.loss_tolerance == 1e-3 and settings.labels() == []


def test_overlap_is_labelled_for_reports_but_does_not_wake_the_guard() -> None:
    """``enabled()`` (what the guard checks) leaves overlap out (it changes no ratio); ``labels()`` names it."""
    settings = AccelerateConfig(compile="both", overlap_groups=2)
    assert settings.enabled() == ["compile=both (regional, mode default)"]
    assert settings.labels() == ["compile=both (regional, mode default)", "overlap_groups=2"]
    assert AccelerateConfig(overlap_groups=1).enabled() == []


def test_gpu_only_speedups_are_refused_on_a_cpu_naming_the_field() -> None:
    problems = AccelerateConfig(compile="both", cuda_graphs=True, attention_backend="flash").problems("cpu")
    assert any(p.startswith("speedups.cuda_graphs: CUDA graphs need a CUDA device") for p in problems), problems
    assert any(p.startswith("speedups.attention_backend: 'flash' needs a GPU") for p in problems), problems
    assert AccelerateConfig(cuda_graphs=True).problems("cuda")[0].startswith("speedups.cuda_graphs: CUDA graphs are")
    for name in ("native", "_native_math", "_native_flash"):
        assert AccelerateConfig(attention_backend=name).problems("cpu") == [], name


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        (AccelerateConfig(attention_backend="flashy"), "speedups.attention_backend: unknown backend 'flashy'"),
        (AccelerateConfig(attention_backend="flash_hub"), "speedups.attention_backend: 'flash_hub' downloads"),
        (AccelerateConfig(autocast="float16"), "speedups.autocast: float16 in the training path"),
        (AccelerateConfig(ratio_tolerance=0.0), "speedups.ratio_tolerance: must be a positive"),
        (AccelerateConfig(ratio_tolerance=float("nan")), "speedups.ratio_tolerance: must be a positive"),
        (AccelerateConfig(loss_tolerance=-1e-3), "speedups.loss_tolerance: must be a positive"),
        (AccelerateConfig(loss_tolerance=float("inf")), "speedups.loss_tolerance: must be a positive"),
        (AccelerateConfig(guard_groups=0), "speedups.guard_groups: must be >= 1"),
    ],
)
def test_bad_settings_name_their_field(settings: AccelerateConfig, field: str) -> None:
    problems = settings.problems("cpu")
    assert any(p.startswith(field) for p in problems), problems


def test_float16_autocast_is_allowed_for_the_rollout_only() -> None:
    assert AccelerateConfig(autocast="float16", autocast_scope="rollout").problems("cpu") == []


def test_every_diffusers_backend_name_is_known() -> None:
    names = attention_backend_names()
    assert {"native", "_native_flash", "flash", "sage", "xformers"} <= set(names)


def test_recipe_validation_reports_accelerate_problems_under_run() -> None:
    host = build_host()
    pairs = [("run.speedups.cuda_graphs", "true"), ("run.speedups.autocast", "float16")]
    with pytest.raises(RecipeError) as info:
        validate(parse_recipe([TINY_TREE], pairs, host), host)
    text = str(info.value)
    assert "run.speedups.cuda_graphs: CUDA graphs are captured by torch.compile" in text
    assert "run.speedups.autocast: float16 in the training path" in text


def test_a_model_without_speedups_is_refused() -> None:
    from tests.toy_components import ToyPolicy

    settings = AccelerateConfig(compile="rollout")
    assert not isinstance(ToyPolicy(), Accelerable)
    (problem,) = acceleration_problems(settings, ToyPolicy())
    assert problem.startswith("run.speedups: model 'toy-policy' (ToyPolicy) does not support speed-ups")
    assert acceleration_problems(AccelerateConfig(), ToyPolicy()) == []  # nothing on: nothing to apply
    with pytest.raises(ValueError, match="does not support speed-ups"):
        apply_acceleration(ToyPolicy(), settings)


# ------------------------------------------------------------------------------------------------ paths


class _Counted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.lin(x),)


@pytest.mark.parametrize(
    ("scope", "compiled_paths"),
    [("rollout", {"rollout"}), ("train", {"train"}), ("both", {"rollout", "train"})],
)
def test_compile_scope_picks_the_path_by_gradient_mode(scope: str, compiled_paths: set[str]) -> None:
    """The path that is not in ``compile`` runs eagerly (``set_stance("force_eager")``): counted with dynamo's
    CompileCounter backend, which records a frame each time dynamo compiles the module's forward."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    module = _Counted()
    counter = CompileCounter()
    module.compile(backend=counter)
    speedups = Speedups(AccelerateConfig(compile=scope), torch.device("cpu"))  # type: ignore[arg-type]
    x = torch.randn(2, 4)
    seen = set()
    for path in ("rollout", "train"):
        before = counter.frame_count
        with torch.set_grad_enabled(path == "train"):
            out = speedups.call(module, x)
        assert_fp32_close(out[0].detach(), module.lin(x).detach())
        if counter.frame_count > before:
            seen.add(path)
    assert seen == compiled_paths
    torch._dynamo.reset()


def test_autocast_applies_on_its_scope_only() -> None:
    speedups = Speedups(AccelerateConfig(autocast="bfloat16", autocast_scope="rollout"), torch.device("cpu"))
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert speedups.call(lin, x).dtype == torch.bfloat16
    assert speedups.call(lin, x).dtype == torch.float32  # gradients on: the training path, no autocast


def test_bypassed_calls_run_as_without_speedups() -> None:
    """Inside ``bypassed()`` no autocast and no compiled code on either path (the loss guard's reference); outside,
    the speed-ups again. Nested contexts restore on the outer exit only."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    module = _Counted()
    counter = CompileCounter()
    module.compile(backend=counter)
    speedups = Speedups(AccelerateConfig(compile="both", autocast="bfloat16"), torch.device("cpu"))
    x = torch.randn(2, 4)
    with speedups.bypassed():
        with speedups.bypassed():
            for grad in (False, True):
                with torch.set_grad_enabled(grad):
                    out = speedups.call(module, x)[0]
                assert out.dtype == torch.float32 and torch.equal(out, module.lin(x))
        assert speedups.call(module, x)[0].dtype == torch.float32  # still bypassed: the outer context is open
    assert counter.frame_count == 0  # nothing was compiled while bypassed
    assert speedups.call(module, x)[0].dtype == torch.bfloat16 and counter.frame_count == 1
    torch._dynamo.reset()


def test_policy_without_speedups_equals_the_plain_policy(make_sd3_policy: Callable[..., Any]) -> None:
    """``Accelerable.without_speedups``: bf16 autocast and a restricted SDPA kernel are off inside it, so the
    accelerated policy's velocity equals the plain policy's bit for bit; outside it they differ."""
    lora = LoraSpec(rank=4, alpha=8)
    plain, fast = make_sd3_policy(lora=lora), make_sd3_policy(lora=lora)
    with plain.without_speedups():  # nothing applied: a no-op
        pass
    fast.accelerate(AccelerateConfig(autocast="bfloat16", attention_backend="_native_math"))
    assert isinstance(fast, Accelerable)
    latents = plain.initial_noise(2, torch.Generator().manual_seed(0))
    sigma = torch.full((2,), 0.5)
    cond = plain.encode(["a cat", "a dog"])
    with torch.no_grad():
        reference = plain.velocity(latents, sigma, cond)
        with fast.without_speedups():
            bypassed = fast.velocity(latents, sigma, fast.encode(["a cat", "a dog"]))
        accelerated = fast.velocity(latents, sigma, fast.encode(["a cat", "a dog"]))
    assert torch.equal(bypassed, reference)
    assert not torch.equal(accelerated, reference)


# ------------------------------------------------------------------------------------------------ hooks


def test_sd3_repeated_blocks_are_its_transformer_blocks(make_sd3_policy: Callable[..., Any]) -> None:
    transformer = make_sd3_policy().transformer
    blocks = repeated_blocks(transformer)
    assert blocks and all(type(b).__name__ == "JointTransformerBlock" for b in blocks)
    assert len(blocks) == transformer.config.num_layers


def test_flux_repeated_blocks_follow_diffusers_list(make_flux_policy: Callable[..., Any]) -> None:
    transformer = make_flux_policy().transformer
    names = {type(b).__name__ for b in repeated_blocks(transformer)}
    assert names == set(transformer._repeated_blocks)


def test_compile_in_place_keeps_lora_parameters_and_state(make_sd3_policy: Callable[..., Any]) -> None:
    """``nn.Module.compile`` is lazy and in place: same parameters, same state-dict keys (checkpoints, save_lora)."""
    policy = make_sd3_policy(lora=LoraSpec(rank=4, alpha=8))
    params = policy.trainable_parameters()
    keys = set(policy.state_dict()["lora"])
    policy.accelerate(AccelerateConfig(compile="both"))
    speedups = policy._speedups
    assert speedups is not None and speedups.compiled_modules == len(repeated_blocks(policy.transformer))
    assert [id(p) for p in policy.trainable_parameters()] == [id(p) for p in params]
    assert set(policy.state_dict()["lora"]) == keys
    torch._dynamo.reset()


def test_sd3_maps_native_backends_onto_torch_sdpa_and_refuses_others(make_sd3_policy: Callable[..., Any]) -> None:
    """SD3's JointAttnProcessor2_0 calls torch SDPA itself: ``_native_math`` becomes an ``sdpa_kernel`` context, and
    a backend that needs diffusers' dispatcher is refused at setup, naming the field."""
    from torch.nn.attention import SDPBackend

    policy = make_sd3_policy()
    x = policy.initial_noise(2, torch.Generator().manual_seed(0))
    cond, sigma = policy.encode(["a cat", "a dog"]), policy.sigmas(4)[1].expand(2)
    with torch.no_grad():
        plain = policy.velocity(x, sigma, cond)
    policy.accelerate(AccelerateConfig(attention_backend="_native_math"))
    assert policy._speedups is not None and policy._speedups._sdpa == [SDPBackend.MATH]
    with torch.no_grad():
        assert_fp32_close(policy.velocity(x, sigma, cond), plain, atol=KERNEL_ATOL)
    with pytest.raises(ValueError, match=r"run\.speedups\.attention_backend: 'flash' needs attention processors"):
        make_sd3_policy().accelerate(AccelerateConfig(attention_backend="flash"))


def test_flux_sets_the_backend_on_its_dispatching_processors(make_flux_policy: Callable[..., Any]) -> None:
    policy = make_flux_policy()
    policy.accelerate(AccelerateConfig(attention_backend="_native_math"))
    backends = {str(p._attention_backend.value) for p in policy.transformer.attn_processors.values()}
    assert backends == {"_native_math"}
    assert policy._speedups is not None and policy._speedups._sdpa is None


@pytest.mark.parametrize("family", ["sd3", "wan"])
def test_channels_last_vae_weights(family: str, request: pytest.FixtureRequest) -> None:
    """2-D convolutions become channels-last, 3-D ones (Wan's causal VAE) channels-last-3d; decoding is unchanged up
    to a rounding level."""
    make = request.getfixturevalue("make_sd3_policy" if family == "sd3" else "make_wan_policy")
    policy = make()
    latents = policy.initial_noise(1, torch.Generator().manual_seed(0))
    plain = policy.decode(latents)
    policy.accelerate(AccelerateConfig(vae_channels_last=True))
    convs = [m for m in policy.pipe.vae.modules() if isinstance(m, (nn.Conv2d, nn.Conv3d))]
    assert convs
    for conv in convs:
        fmt = torch.channels_last if conv.weight.ndim == 4 else torch.channels_last_3d
        assert conv.weight.is_contiguous(memory_format=fmt), type(conv).__name__
    assert int((policy.decode(latents).int() - plain.int()).abs().max()) <= 1
