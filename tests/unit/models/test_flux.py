"""FluxPolicy on a tiny real-architecture FLUX.1 pipeline: pipeline equivalence (packing, dynamic shift, guidance
input), caching, SDE log-probs, ratios, LoRA export, reference models and errors (mirrors test_sd3.py)."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import FluxPipeline

from rlpost.models import FluxPolicy, LoraSpec, ModelDirError
from rlpost.models import flux as flux_module
from rlpost.models.flux import flux_mu, pack_latents, unpack_latents
from rlpost.ops.kernels import DanceGRPOSDE, EulerODE, FlowGRPOSDE, StepKernel
from rlpost.ops.schedules import shifted_linspace_sigmas, time_shift
from tests.tolerances import assert_fp32_close, assert_pixels_close

PROMPTS = ["a photo of a cat", "a red dog"]
NFE = 5


def _sample(policy: FluxPolicy, x: torch.Tensor, prompts: list[str], kernel: StepKernel, nfe: int) -> torch.Tensor:
    cond = policy.encode(prompts)
    sig = policy.sigmas(nfe)
    b = x.shape[0]
    with torch.no_grad():
        for i in range(nfe):
            s, sn = sig[i].expand(b), sig[i + 1].expand(b)
            x = kernel.step(x, policy.velocity(x, s, cond), s, sn, None).next_latents
    return x


def _perturb_lora(policy: FluxPolicy, scale: float = 0.5) -> None:
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in policy.transformer.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=g) * scale)


def _pipe(tiny_flux_dir: Path) -> FluxPipeline:
    pipe = FluxPipeline.from_pretrained(str(tiny_flux_dir), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pipe_latents(pipe: FluxPipeline, x0: torch.Tensor, prompts: list[str], nfe: int, **kw: Any) -> Any:
    kw = dict(num_inference_steps=nfe, guidance_scale=3.5, height=32, width=32, max_sequence_length=32) | kw
    return pipe(prompts, latents=pack_latents(x0.clone()), **kw).images


def test_pack_unpack_match_the_pipeline() -> None:
    x = torch.randn(2, 4, 8, 6, generator=torch.Generator().manual_seed(0))
    packed = pack_latents(x)
    assert torch.equal(packed, FluxPipeline._pack_latents(x, 2, 4, 8, 6))
    assert torch.equal(unpack_latents(packed, 8, 6), x)
    # the pipeline's unpack takes pixel sizes and the VAE factor (2 here)
    assert torch.equal(FluxPipeline._unpack_latents(packed, 16, 12, 2), x)


def test_ode_sampling_reproduces_pipeline(make_flux_policy: Callable[..., FluxPolicy], tiny_flux_dir: Path) -> None:
    policy = make_flux_policy()
    x0 = policy.initial_noise(2, torch.Generator().manual_seed(0))
    assert x0.shape == (2, 4, 16, 16) and x0.dtype == torch.float32
    ours = _sample(policy, x0, PROMPTS, EulerODE(), NFE)
    assert policy.forward_count == 2 * NFE  # one forward per row: distilled guidance, no CFG pass
    pipe = _pipe(tiny_flux_dir)
    ref = unpack_latents(_pipe_latents(pipe, x0, PROMPTS, NFE, output_type="latent"), 16, 16)
    # Same formulas through separate code (our Euler step vs the scheduler's): equal up to float rounding.
    assert (ours - ref).abs().max() <= 1e-5
    assert (ours - x0).abs().max() > 0.1  # the comparison is not vacuous
    img = policy.decode(ours)
    assert img.shape == (2, 1, 32, 32, 3) and img.dtype == torch.uint8  # one-frame media
    img = img[:, 0]
    ref_img = _pipe_latents(pipe, x0, PROMPTS, NFE, output_type="pt")  # [B, 3, H, W] in [0, 1]
    assert_pixels_close(img, (ref_img * 255).round().to(torch.uint8).permute(0, 2, 3, 1))
    # The same prompt embeddings (our cache) and the same seed (the pipeline draws its own noise): the same images.
    cond = policy.encode(PROMPTS).tensors
    seeded = pipe(
        prompt_embeds=cond["prompt_embeds"],
        pooled_prompt_embeds=cond["pooled_prompt_embeds"],
        generator=torch.Generator().manual_seed(0),
        num_inference_steps=NFE,
        guidance_scale=3.5,
        height=32,
        width=32,
        output_type="pt",
    ).images
    assert_pixels_close(img, (seeded * 255).round().to(torch.uint8).permute(0, 2, 3, 1))


def test_guidance_is_a_transformer_input(make_flux_policy: Callable[..., FluxPolicy], tiny_flux_dir: Path) -> None:
    """Another distilled guidance scale changes the velocity (it reaches the guidance embedding) and still matches
    the pipeline run at that scale."""
    low, high = make_flux_policy(guidance_scale=1.0), make_flux_policy(guidance_scale=7.0)
    x = low.initial_noise(1, torch.Generator().manual_seed(2))
    s = torch.full((1,), 0.6)
    with torch.no_grad():
        v_low = low.velocity(x, s, low.encode(PROMPTS[:1]))
        v_high = high.velocity(x, s, high.encode(PROMPTS[:1]))
    assert (v_low - v_high).abs().max() > 1e-3
    ours = _sample(high, x, PROMPTS[:1], EulerODE(), 2)
    ref = _pipe_latents(_pipe(tiny_flux_dir), x, PROMPTS[:1], 2, guidance_scale=7.0, output_type="latent")
    assert (ours - unpack_latents(ref, 16, 16)).abs().max() <= 1e-5


def test_initial_noise_is_the_pipelines(make_flux_policy: Callable[..., FluxPolicy], tiny_flux_dir: Path) -> None:
    policy = make_flux_policy()
    ours = policy.initial_noise(3, torch.Generator().manual_seed(4))
    pipe = _pipe(tiny_flux_dir)
    packed, _ = pipe.prepare_latents(3, 4, 32, 32, torch.float32, "cpu", torch.Generator().manual_seed(4))
    assert torch.equal(pack_latents(ours), packed)


def test_sigmas_dynamic_shift_from_resolution(make_flux_policy: Callable[..., FluxPolicy], tiny_flux_dir: Path) -> None:
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    policy = make_flux_policy()
    assert policy.image_seq_len == 64
    assert policy.mu == pytest.approx(calculate_shift(64, 256, 4096, 0.5, 1.15), abs=1e-12)
    # The pipeline's own scheduler after a call: bit for bit.
    pipe = _pipe(tiny_flux_dir)
    _pipe_latents(pipe, policy.initial_noise(1, torch.Generator().manual_seed(0)), PROMPTS[:1], 7, output_type="latent")
    assert torch.equal(policy.sigmas(7), pipe.scheduler.sigmas)
    # An independent formula: FLUX's exponential shift with mu is SD3's static shift with s = e^mu.
    s = math.exp(policy.mu)
    assert_fp32_close(policy.sigmas(7), time_shift(torch.linspace(1, 0, 8, dtype=torch.float64), s).float())
    # Resolution-dependent: 64 px has 4x the image tokens, a larger mu and a later (noisier) grid.
    big = make_flux_policy(resolution=64)
    assert big.image_seq_len == 256 and big.mu == pytest.approx(0.5)
    assert (big.sigmas(7)[1:-1] > policy.sigmas(7)[1:-1]).all()
    static = make_flux_policy(time_grid="shifted-linspace")
    assert torch.equal(static.sigmas(7), shifted_linspace_sigmas(7, 3.0))  # the config's shift, DanceGRPO's 3
    two = make_flux_policy(time_grid="shifted-linspace", shift=2.0)
    assert torch.equal(two.sigmas(3), shifted_linspace_sigmas(3, 2.0))
    assert policy.clean_tail_steps() == 1 and static.clean_tail_steps() == 1


def test_flux_mu_is_linear_in_tokens() -> None:
    cfg = {"base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5, "max_shift": 1.15}
    assert flux_mu(256, cfg) == pytest.approx(0.5) and flux_mu(4096, cfg) == pytest.approx(1.15)
    assert flux_mu(1024, cfg) == pytest.approx(0.5 + 0.65 * 768 / 3840)  # 512 px FLUX.1-dev


def test_encode_is_cached_per_prompt(
    make_flux_policy: Callable[..., FluxPolicy], monkeypatch: pytest.MonkeyPatch
) -> None:
    policy = make_flux_policy()
    calls: list[list[str]] = []
    real = policy.pipe.encode_prompt

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(list(kwargs["prompt"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(policy.pipe, "encode_prompt", spy)
    c1 = policy.encode(["a", "b", "a"])
    c2 = policy.encode(["b", "c", "a", "a"])
    assert calls == [["a", "b"], ["c"]]
    assert set(c1.tensors) == {"prompt_embeds", "pooled_prompt_embeds"}
    assert c1.tensors["prompt_embeds"].shape == (3, 32, 32) and c2.tensors["pooled_prompt_embeds"].shape == (4, 32)
    assert torch.equal(c1.tensors["prompt_embeds"][0], c2.tensors["prompt_embeds"][2])


@pytest.mark.parametrize("kernel", [DanceGRPOSDE(0.3), FlowGRPOSDE(0.7)], ids=["dance-sde", "flow-sde"])
def test_sde_log_prob_is_an_independent_gaussian_density(
    make_flux_policy: Callable[..., FluxPolicy], kernel: StepKernel
) -> None:
    """The kernel's log-prob of a FLUX step equals torch.distributions.Normal's density at the mean and std written
    out here from the papers' formulas (DanceGRPO flux_step; Flow-GRPO eq. 9-10), averaged over latent elements."""
    policy = make_flux_policy()
    cond = policy.encode(PROMPTS)
    sig = policy.sigmas(4)
    x = policy.initial_noise(2, torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for i in range(3):
            s, sn = sig[i].expand(2), sig[i + 1].expand(2)
            v = policy.velocity(x, s, cond)
            out = kernel.step(x, v, s, sn, gen)
            si, sni = float(sig[i]), float(sig[i + 1])
            dt = sni - si
            if isinstance(kernel, DanceGRPOSDE):
                x0 = x - si * v
                score = -(x - (1 - si) * x0) / si**2
                mean, std = x + dt * (v - 0.5 * 0.3**2 * score), 0.3 * math.sqrt(-dt)
            else:
                denom = sni if si == 1.0 else si  # Flow-GRPO's sigma_max = sigmas[1] at the first step
                st = 0.7 * math.sqrt(si / (1 - denom))
                mean = x + dt * (v + st**2 / (2 * si) * (x + (1 - si) * v))
                std = st * math.sqrt(-dt)
            expected = torch.distributions.Normal(mean.double(), std).log_prob(out.next_latents.double())
            assert_fp32_close(out.log_prob.double(), expected.flatten(1).mean(1), rtol=1e-5, atol=1e-5)
            assert_fp32_close(kernel.log_prob(out.next_latents, out.mean, out.std), out.log_prob)
            x = out.next_latents


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_recomputed_log_prob_gives_ratio_one(make_flux_policy: Callable[..., FluxPolicy], lora: bool) -> None:
    """Before any update, exp(logp_new - logp_old) == 1 up to fp32 rounding (XueZeyue/DanceGRPO issue #87)."""
    kw: dict[str, Any] = (
        {"lora": LoraSpec(rank=4, alpha=4), "gradient_checkpointing": True} if lora else {"full_finetune": True}
    )
    policy = make_flux_policy(**kw)
    if lora:
        _perturb_lora(policy)
    kernel = DanceGRPOSDE(0.3)
    cond = policy.encode(PROMPTS)
    sig = policy.sigmas(4)
    x = policy.initial_noise(2, torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    stored = []
    policy.train(False)
    with torch.no_grad():
        for i in range(3):
            s, sn = sig[i].expand(2), sig[i + 1].expand(2)
            out = kernel.step(x, policy.velocity(x, s, cond), s, sn, gen)
            stored.append((x, s, sn, out.next_latents, out.log_prob))
            x = out.next_latents
    policy.train(True)
    for x_i, s, sn, nxt, old in stored:
        mean, std = kernel.mean_std(x_i, policy.velocity(x_i, s, cond), s, sn)
        new = kernel.log_prob(nxt, mean, std)
        assert new.requires_grad
        ratio = torch.exp(new - old)
        # As in test_sd3: room for last-bit differences of a forward with autograd on; a log-prob computed
        # differently at the two ends is off by orders more.
        assert torch.allclose(ratio, torch.ones_like(ratio), rtol=0, atol=1e-6), ratio
        new.sum().backward()


def test_lora_gradients_only_reach_adapter(make_flux_policy: Callable[..., FluxPolicy]) -> None:
    policy = make_flux_policy(lora=LoraSpec(rank=4, alpha=8))
    _perturb_lora(policy)
    names = {n for n, p in policy.transformer.named_parameters() if p.requires_grad}
    assert names and all("lora_" in n for n in names)
    assert len(names) == len(policy.trainable_parameters())
    assert any("single_transformer_blocks" in n for n in names)  # the suffixes reach both block kinds
    x = policy.initial_noise(2, torch.Generator().manual_seed(0))
    policy.train(True)
    policy.velocity(x, torch.full((2,), 0.7), policy.encode(PROMPTS)).square().mean().backward()
    for n, p in policy.transformer.named_parameters():
        assert (p.grad is not None) == ("lora_" in n), n
    for m in (policy.pipe.text_encoder, policy.pipe.text_encoder_2, policy.pipe.vae):
        assert all(p.grad is None and not p.requires_grad for p in m.parameters())


def test_saved_lora_loads_into_fresh_pipeline(
    make_flux_policy: Callable[..., FluxPolicy], tiny_flux_dir: Path, tmp_path: Path
) -> None:
    policy = make_flux_policy(lora=LoraSpec(rank=4, alpha=8))
    x0 = policy.initial_noise(1, torch.Generator().manual_seed(3))
    base = _sample(policy, x0, PROMPTS[:1], EulerODE(), 3)
    _perturb_lora(policy)
    trained = _sample(policy, x0, PROMPTS[:1], EulerODE(), 3)
    assert (trained - base).abs().max() > 1e-3  # the adapter has an effect
    out = policy.save_lora(tmp_path / "lora")
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    pipe = _pipe(tiny_flux_dir)
    pipe.load_lora_weights(str(out))
    ref = unpack_latents(_pipe_latents(pipe, x0, PROMPTS[:1], 3, output_type="latent"), 16, 16)
    assert (ref - trained).abs().max() <= 1e-5


def test_lora_reference_disables_adapter(make_flux_policy: Callable[..., FluxPolicy]) -> None:
    policy = make_flux_policy(lora=LoraSpec(rank=4, alpha=8))
    frozen = make_flux_policy()
    _perturb_lora(policy)
    x = policy.initial_noise(2, torch.Generator().manual_seed(0))
    s = torch.full((2,), 0.5)
    with torch.no_grad():
        v_pol = policy.velocity(x, s, policy.encode(PROMPTS))
        with policy.reference():
            v_ref = policy.velocity(x, s, policy.encode(PROMPTS))
        v_after = policy.velocity(x, s, policy.encode(PROMPTS))
        v_base = frozen.velocity(x, s, frozen.encode(PROMPTS))
    assert_fp32_close(v_ref, v_base)
    assert_fp32_close(v_after, v_pol)
    assert not torch.allclose(v_pol, v_ref)


def test_full_finetune_reference_copy(make_flux_policy: Callable[..., FluxPolicy]) -> None:
    policy = make_flux_policy(full_finetune=True, reference=True)
    assert len(policy.trainable_parameters()) == sum(1 for _ in policy.transformer.parameters())
    x = policy.initial_noise(1, torch.Generator().manual_seed(0))
    s, cond = torch.full((1,), 0.5), policy.encode(PROMPTS[:1])
    with torch.no_grad():
        before = policy.velocity(x, s, cond)
        for p in policy.trainable_parameters():
            p.add_(0.01)
        with policy.reference():
            ref = policy.velocity(x, s, cond)
        after = policy.velocity(x, s, cond)
    assert_fp32_close(ref, before)  # a deep copy: equal up to fp32 rounding (tests/tolerances.py)
    assert not torch.allclose(after, before)
    with pytest.raises(NotImplementedError, match="reference=True"):
        make_flux_policy(full_finetune=True).reference()
    assert make_flux_policy().trainable_parameters() == []


def test_bfloat16_weights_give_fp32_velocity(make_flux_policy: Callable[..., FluxPolicy]) -> None:
    policy = make_flux_policy(dtype="bfloat16", lora=LoraSpec(rank=4, alpha=4))
    assert policy.weight_dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in policy.trainable_parameters())
    x = policy.initial_noise(1, torch.Generator().manual_seed(0))
    v = policy.velocity(x, torch.full((1,), 0.5), policy.encode(PROMPTS[:1]))
    assert v.dtype == torch.float32 and v.shape == x.shape and torch.isfinite(v).all()


def test_missing_or_malformed_model_dir(tiny_flux_dir: Path, tmp_path: Path) -> None:
    def setup_error(path: Path | str) -> str:
        with pytest.raises((ModelDirError, OSError)) as info:
            FluxPolicy(str(path), resolution=32).setup(torch.device("cpu"))
        return str(info.value)

    assert "does not exist" in setup_error(tmp_path / "nope")
    no_tr = tmp_path / "no_tr"
    shutil.copytree(tiny_flux_dir, no_tr)
    shutil.rmtree(no_tr / "transformer")
    assert "transformer/" in setup_error(no_tr)
    no_entry = tmp_path / "no_entry"
    shutil.copytree(tiny_flux_dir, no_entry)
    index = json.loads((no_entry / "model_index.json").read_text())
    del index["text_encoder_2"]
    (no_entry / "model_index.json").write_text(json.dumps(index))
    assert "'text_encoder_2'" in setup_error(no_entry)
    problems = FluxPolicy(str(no_tr), resolution=32).validate(None)
    assert len(problems) == 1 and "transformer/" in problems[0]
    assert FluxPolicy(str(tiny_flux_dir), resolution=32).validate(None) == []


def test_validation_names_the_field(tiny_flux_dir: Path) -> None:
    # 2x2 packing on a VAE factor 2: a multiple of 4 pixels
    (bad,) = FluxPolicy(str(tiny_flux_dir), resolution=30).validate(None)
    assert bad.startswith("model.init_args.resolution:") and "multiple of 4" in bad
    (shift,) = FluxPolicy(str(tiny_flux_dir), resolution=32, shift=3.0).validate(None)
    assert shift.startswith("model.init_args.shift:") and "shifted-linspace" in shift
    assert FluxPolicy(str(tiny_flux_dir), resolution=32, time_grid="shifted-linspace", shift=3.0).validate(None) == []
    (grid,) = FluxPolicy(str(tiny_flux_dir), resolution=32, time_grid="karras").validate(None)  # type: ignore[arg-type]
    assert grid.startswith("model.init_args.time_grid:")
    with pytest.raises(ValueError, match="multiple of 4"):
        FluxPolicy(str(tiny_flux_dir), resolution=30, dtype="float32").setup(torch.device("cpu"))
    with pytest.raises(ValueError, match="not both"):
        FluxPolicy("x", lora=LoraSpec(), full_finetune=True)


def test_tiny_random_id_builds_into_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLPOST_CACHE", str(tmp_path))
    policy = FluxPolicy("tiny-random", resolution=32, dtype="float32", max_sequence_length=8)
    assert policy.validate(None) == []
    policy.setup(torch.device("cpu"))
    assert (tmp_path / "tiny-flux-seed0" / "model_index.json").is_file()
    assert type(policy.pipe).__name__ == "FluxPipeline" and policy.transformer.config.guidance_embeds


def test_registers_through_hook() -> None:
    registered: list[type] = []
    flux_module.rlpost_register_models(registered.append)
    assert registered == [FluxPolicy] and FluxPolicy.name == "flux" and FluxPolicy.kind == "model"
