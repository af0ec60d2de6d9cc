"""WanPolicy on a tiny real-architecture Wan2.1 T2V pipeline: pipeline equivalence (CFG, video latents, decoded
frames), grids (flow-match Euler, UniPC flow sigmas, shifted-linspace), SDE log-probs on 5-D latents, ratios, LoRA
export into ``WanPipeline``, reference models and validation errors (mirrors test_flux.py)."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import WanPipeline

import rlpost.models.wan as wan_module
from rlpost.apps.host import build_host
from rlpost.components.chain import ChainPlan, run_chains
from rlpost.core.contract import PromptBatch
from rlpost.models import LoraSpec, ModelDirError
from rlpost.models.tiny_wan import WAN21_UNIPC_SCHEDULER
from rlpost.models.wan import WanPolicy
from rlpost.models.wan_geometry import WanGeometry, wan_diffusers_sigmas
from rlpost.ops.kernels import DanceGRPOSDE, EulerODE, FlowGRPOSDE, StepKernel
from rlpost.ops.sampling import evaluate_edges
from rlpost.ops.schedules import shifted_linspace_sigmas, time_shift
from tests.argument_checks import problems_of
from tests.models_fixtures_wan import *  # noqa: F403  (the fixtures tiny_wan_dir, make_wan_policy)
from tests.models_fixtures_wan import WAN_FRAMES, WAN_HEIGHT, WAN_WIDTH
from tests.tolerances import assert_fp32_close, assert_pixels_close

PROMPTS = ["a photo of a cat", "a red dog"]
NFE = 4
LATENT = (16, 3, WAN_HEIGHT // 8, WAN_WIDTH // 8)  # 9 frames -> 3 latent frames; 32 x 48 px -> 4 x 6
SIZE = dict(height=WAN_HEIGHT, width=WAN_WIDTH, num_frames=WAN_FRAMES, max_sequence_length=32)

WAN21_UNIPC = dict(WAN21_UNIPC_SCHEDULER)  # the released scheduler config (rlpost/models/tiny_wan.py)


def _sample(policy: WanPolicy, x: torch.Tensor, prompts: list[str], kernel: StepKernel, nfe: int) -> torch.Tensor:
    cond = policy.encode(prompts)
    sig = policy.sigmas(nfe)
    b = x.shape[0]
    with torch.no_grad():
        for i in range(nfe):
            s, sn = sig[i].expand(b), sig[i + 1].expand(b)
            x = kernel.step(x, policy.velocity(x, s, cond), s, sn, None).next_latents
    return x


def _perturb_lora(policy: WanPolicy, scale: float = 0.5) -> None:
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in policy.transformer.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=g) * scale)


def _pipe(directory: Path) -> WanPipeline:
    pipe = WanPipeline.from_pretrained(str(directory), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pipe_out(pipe: WanPipeline, x0: torch.Tensor | None, prompts: list[str], nfe: int, **kw: Any) -> Any:
    kw = dict(SIZE, num_inference_steps=nfe, guidance_scale=5.0) | kw
    if x0 is not None:
        kw["latents"] = x0.clone()
    return pipe(prompts, **kw).frames


def _frames_u8(frames: Any) -> torch.Tensor:
    """The pipeline's ``output_type="pt"`` ``[B, F, 3, H, W]`` in [0, 1] -> ``[B, F, H, W, 3]`` uint8 (PIL rounding)."""
    return (frames * 255).round().to(torch.uint8).permute(0, 1, 3, 4, 2)


@pytest.mark.parametrize("guidance", [5.0, 1.0], ids=["cfg", "no-cfg"])
def test_ode_sampling_reproduces_pipeline(
    make_wan_policy: Callable[..., WanPolicy], tiny_wan_dir: Path, guidance: float
) -> None:
    """Euler ODE along policy.sigmas == WanPipeline.__call__ from the same noise (CFG on and off), and the decoded
    frames equal the pipeline's within one level."""
    policy = make_wan_policy(guidance_scale=guidance)
    x0 = policy.initial_noise(2, torch.Generator().manual_seed(0))
    assert x0.shape == (2, *LATENT) and x0.dtype == torch.float32
    ours = _sample(policy, x0, PROMPTS, EulerODE(), NFE)
    assert policy.forward_count == 2 * NFE  # rows before CFG doubling
    pipe = _pipe(tiny_wan_dir)
    ref = _pipe_out(pipe, x0, PROMPTS, NFE, guidance_scale=guidance, output_type="latent")
    # Same formulas through separate code (our Euler step and one batched CFG forward vs the scheduler's step and
    # the pipeline's two forwards): equal up to float rounding. Measured 2.1e-6 with CFG on |x| ~ 3.
    assert (ours - ref).abs().max() <= 1e-5
    assert (ours - x0).abs().max() > 0.1  # the comparison is not vacuous
    frames = policy.decode(ours)
    assert frames.shape == (2, WAN_FRAMES, WAN_HEIGHT, WAN_WIDTH, 3) and frames.dtype == torch.uint8
    assert policy.frames == WAN_FRAMES
    assert frames.float().std() > 5  # real content, not a constant frame
    assert_pixels_close(
        frames, _frames_u8(_pipe_out(pipe, x0, PROMPTS, NFE, guidance_scale=guidance, output_type="pt"))
    )
    np_frames = _pipe_out(pipe, x0, PROMPTS, NFE, guidance_scale=guidance, output_type="np")  # [B, F, H, W, 3]
    assert_pixels_close(frames, torch.from_numpy(np.round(np_frames * 255).astype(np.uint8)))
    # The pipeline drawing its own noise from the same seed, on our cached embeddings: the same frames.
    cond = policy.encode(PROMPTS).tensors
    embeds = {"prompt_embeds": cond["prompt_embeds"]}
    if guidance > 1:
        embeds["negative_prompt_embeds"] = cond["negative_prompt_embeds"]
    seeded = pipe(
        **embeds, **SIZE, num_inference_steps=NFE, guidance_scale=guidance, output_type="pt",
        generator=torch.Generator().manual_seed(0),
    ).frames  # fmt: skip
    assert_pixels_close(frames, _frames_u8(seeded))


def test_initial_noise_is_the_pipelines(make_wan_policy: Callable[..., WanPolicy], tiny_wan_dir: Path) -> None:
    policy = make_wan_policy()
    ours = policy.initial_noise(3, torch.Generator().manual_seed(4))
    pipe = _pipe(tiny_wan_dir)
    theirs = pipe.prepare_latents(
        3, 16, WAN_HEIGHT, WAN_WIDTH, WAN_FRAMES, torch.float32, "cpu", torch.Generator().manual_seed(4)
    )
    assert_fp32_close(ours, theirs)  # one randn draw of one shape on each side
    assert policy.latent_shape == LATENT


def test_sigmas_are_the_schedulers(make_wan_policy: Callable[..., WanPolicy], tiny_wan_dir: Path) -> None:
    policy = make_wan_policy()
    pipe = _pipe(tiny_wan_dir)
    _pipe_out(pipe, None, PROMPTS[:1], 7, generator=torch.Generator().manual_seed(0), output_type="latent")
    assert_fp32_close(policy.sigmas(7), pipe.scheduler.sigmas)  # the pipeline's own scheduler after a call
    assert policy.sigmas(7)[-2] < 0.01 and policy.clean_tail_steps() == 2  # ... -> σ_min -> 0
    static = make_wan_policy(time_grid="shifted-linspace")
    assert_fp32_close(static.sigmas(7), shifted_linspace_sigmas(7, 3.0))  # the config's shift, DanceGRPO's 3
    assert static.clean_tail_steps() == 1
    five = make_wan_policy(shift=5.0)  # WanPipeline's docs: flow_shift 5.0 for 720p
    from diffusers import FlowMatchEulerDiscreteScheduler

    reference = FlowMatchEulerDiscreteScheduler(shift=5.0)
    reference.set_timesteps(7)
    assert_fp32_close(five.sigmas(7), reference.sigmas)
    assert (five.sigmas(7)[1:-1] > policy.sigmas(7)[1:-1]).all()


def test_unipc_flow_grid(tiny_wan_dir: Path, tmp_path: Path) -> None:
    """The released scheduler (UniPC with flow sigmas): its grid, read back from the scheduler, with the first level
    restored to 1; independently, time_shift(linspace(1, 1/1000, T+1)[:-1], 3) then 0."""
    from diffusers import UniPCMultistepScheduler

    unipc = tmp_path / "unipc"
    shutil.copytree(tiny_wan_dir, unipc)
    (unipc / "scheduler" / "scheduler_config.json").write_text(json.dumps(WAN21_UNIPC))
    index = json.loads((unipc / "model_index.json").read_text())
    index["scheduler"] = ["diffusers", "UniPCMultistepScheduler"]
    (unipc / "model_index.json").write_text(json.dumps(index))
    policy = WanPolicy(str(unipc), dtype="float32", **SIZE)
    assert policy.validate(None) == [] and policy.clean_tail_steps() == 1  # answered before loading
    policy.setup(torch.device("cpu"))
    assert type(policy.pipe.scheduler).__name__ == "UniPCMultistepScheduler"
    ours = policy.sigmas(10)
    theirs = UniPCMultistepScheduler.from_config(WAN21_UNIPC)
    theirs.set_timesteps(10)
    assert float(ours[0]) == 1.0 and float(theirs.sigmas[0]) < 1.0  # the scheduler's 1e-6 log-alpha guard
    assert_fp32_close(ours[1:], theirs.sigmas[1:])
    formula = time_shift(torch.from_numpy(np.linspace(1, 1 / 1000, 11)[:-1]), 3.0)
    assert_fp32_close(ours, torch.cat([formula, torch.zeros(1, dtype=torch.float64)]).float())
    assert 0.2 < float(ours[-2]) < 0.3  # ends near shift(1/T) = 0.25, like shifted-linspace
    with pytest.raises(ValueError, match="use_flow_sigmas"):
        wan_diffusers_sigmas(4, {**WAN21_UNIPC, "use_flow_sigmas": False})
    with pytest.raises(ValueError, match="from 1 to 0"):
        wan_diffusers_sigmas(4, {**WAN21_UNIPC, "final_sigmas_type": "sigma_min"})
    with pytest.raises(ValueError, match="supports"):
        wan_diffusers_sigmas(4, {"_class_name": "DDIMScheduler"})


def test_encode_is_cached_and_carries_the_negative_prompt(
    make_wan_policy: Callable[..., WanPolicy], monkeypatch: pytest.MonkeyPatch
) -> None:
    policy = make_wan_policy()
    calls: list[tuple[list[str], Any]] = []
    real = policy.pipe.encode_prompt

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append((list(kwargs["prompt"]), kwargs["negative_prompt"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(policy.pipe, "encode_prompt", spy)
    c1 = policy.encode(["a", "b", "a"])
    c2 = policy.encode(["b", "c", "a"])
    assert calls == [(["a", "b"], ["", ""]), (["c"], [""])]
    assert set(c1.tensors) == {"prompt_embeds", "negative_prompt_embeds"}
    assert c1.tensors["prompt_embeds"].shape == (3, 32, 32)
    assert_fp32_close(c1.tensors["prompt_embeds"][0], c2.tensors["prompt_embeds"][2])
    # Another negative prompt changes only the unconditional branch.
    other = make_wan_policy(negative_prompt="blurry, static")
    x = policy.initial_noise(1, torch.Generator().manual_seed(1))
    s = torch.full((1,), 0.7)
    with torch.no_grad():
        v, v_other = policy.velocity(x, s, policy.encode(PROMPTS[:1])), other.velocity(x, s, other.encode(PROMPTS[:1]))
    assert (v - v_other).abs().max() > 1e-4
    assert set(make_wan_policy(guidance_scale=1.0).encode(["a"]).tensors) == {"prompt_embeds"}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("kernel", [DanceGRPOSDE(0.3), FlowGRPOSDE(0.7)], ids=["dance-sde", "flow-sde"])
def test_sde_log_prob_is_an_independent_gaussian_density(
    make_wan_policy: Callable[..., WanPolicy], kernel: StepKernel, reduction: Any
) -> None:
    """The kernel's log-prob of a Wan step on [B, C, F, h, w] latents equals torch.distributions.Normal's density at
    the mean and std written out here from the papers' formulas (DanceGRPO flux_step; Flow-GRPO eq. 9-10), reduced
    over all C·F·h·w latent elements."""
    policy = make_wan_policy()
    cond = policy.encode(PROMPTS)
    sig = policy.sigmas(4)
    x = policy.initial_noise(2, torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for i in range(3):
            s, sn = sig[i].expand(2), sig[i + 1].expand(2)
            v = policy.velocity(x, s, cond)
            out = kernel.step(x, v, s, sn, gen, reduction=reduction)
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
            density = torch.distributions.Normal(mean.double(), std).log_prob(out.next_latents.double()).flatten(1)
            assert density.shape[1] == math.prod(LATENT)
            expected = density.mean(1) if reduction == "mean" else density.sum(1)
            scale = 1.0 if reduction == "mean" else float(density.shape[1])
            assert_fp32_close(out.log_prob.double(), expected, rtol=1e-5, atol=1e-5 * scale)
            x = out.next_latents


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_recomputed_log_prob_gives_ratio_one(make_wan_policy: Callable[..., WanPolicy], lora: bool) -> None:
    """Before any update, exp(logp_new - logp_old) == 1 (XueZeyue/DanceGRPO issue #87), recomputing through velocity
    with autograd on; every trainable parameter then gets a gradient, and nothing else does."""
    kw: dict[str, Any] = (
        {"lora": LoraSpec(rank=4, alpha=4), "gradient_checkpointing": True} if lora else {"full_finetune": True}
    )
    policy = make_wan_policy(**kw)
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
        assert torch.allclose(ratio, torch.ones_like(ratio), rtol=0, atol=1e-5), ratio
        new.sum().backward()
    trainable = {id(p) for p in policy.trainable_parameters()}
    assert trainable
    for name, p in policy.transformer.named_parameters():
        assert (p.grad is not None) == (id(p) in trainable), name
        if lora:
            assert ("lora_" in name) == (id(p) in trainable), name
    for module in (policy.pipe.text_encoder, policy.pipe.vae):
        assert all(p.grad is None and not p.requires_grad for p in module.parameters())


def test_chain_rollout_and_evaluate_edges_on_video_latents(make_wan_policy: Callable[..., WanPolicy]) -> None:
    """The shared chain rollout and edge re-evaluation (rlpost.components.chain, rlpost.ops.sampling) run on 5-D
    video latents as they are: nodes keep [C, F, h, w], the decoded samples are [S, F, H, W, 3] frames, and
    recomputed log-probs give ratio 1."""
    policy = make_wan_policy(lora=LoraSpec(rank=4, alpha=4))
    _perturb_lora(policy)
    batch = PromptBatch(prompts=PROMPTS, metadata=[{}, {}], samples_per_group=2)
    sde = DanceGRPOSDE(0.3)
    trainable = torch.tensor([[True, True, False]]).repeat(4, 1)
    plan = ChainPlan(policy.sigmas(3), ["dance-sde", "ode"], [sde, EulerODE()], [0, 0, 1], trainable)
    noise = policy.initial_noise(4, torch.Generator().manual_seed(0))
    with torch.no_grad():
        rollout = run_chains(policy, batch, torch.Generator().manual_seed(1), plan, noise, chunk_size=3)
    assert rollout.states.shape == (16, *LATENT)
    assert rollout.media.shape == (4, WAN_FRAMES, WAN_HEIGHT, WAN_WIDTH, 3)
    edges = rollout.trainable.nonzero().flatten()
    assert edges.numel() == 8
    ev = evaluate_edges(policy, rollout, edges, [sde, EulerODE()], "mean")
    assert ev.log_prob.requires_grad and ev.mean.shape == (8, *LATENT)
    ratio = torch.exp(ev.log_prob - rollout.old_log_probs[edges])
    assert torch.allclose(ratio, torch.ones_like(ratio), rtol=0, atol=1e-5), ratio


def test_saved_lora_loads_into_fresh_pipeline(
    make_wan_policy: Callable[..., WanPolicy], tiny_wan_dir: Path, tmp_path: Path
) -> None:
    policy = make_wan_policy(lora=LoraSpec(rank=4, alpha=8))
    names = [n for n, p in policy.transformer.named_parameters() if p.requires_grad]
    assert any(".attn1." in n for n in names) and any(".attn2." in n for n in names)  # self- and cross-attention
    x0 = policy.initial_noise(1, torch.Generator().manual_seed(3))
    base = _sample(policy, x0, PROMPTS[:1], EulerODE(), 3)
    _perturb_lora(policy)
    trained = _sample(policy, x0, PROMPTS[:1], EulerODE(), 3)
    assert (trained - base).abs().max() > 1e-3  # the adapter has an effect
    out = policy.save_lora(tmp_path / "lora")
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    pipe = _pipe(tiny_wan_dir)
    pipe.load_lora_weights(str(out))
    ref = _pipe_out(pipe, x0, PROMPTS[:1], 3, output_type="latent")
    assert (ref - trained).abs().max() <= 1e-5  # alpha/rank restored from the saved metadata
    assert_pixels_close(policy.decode(trained), _frames_u8(_pipe_out(pipe, x0, PROMPTS[:1], 3, output_type="pt")))


def test_lora_reference_disables_adapter(make_wan_policy: Callable[..., WanPolicy]) -> None:
    policy = make_wan_policy(lora=LoraSpec(rank=4, alpha=8))
    frozen = make_wan_policy()
    _perturb_lora(policy)
    x = policy.initial_noise(2, torch.Generator().manual_seed(0))
    s = torch.full((2,), 0.5)
    with torch.no_grad():
        v_pol = policy.velocity(x, s, policy.encode(PROMPTS))
        with policy.reference():
            v_ref = policy.velocity(x, s, policy.encode(PROMPTS))
        v_base = frozen.velocity(x, s, frozen.encode(PROMPTS))
    assert_fp32_close(v_ref, v_base)
    assert not torch.allclose(v_pol, v_ref)


def test_full_finetune_reference_copy(make_wan_policy: Callable[..., WanPolicy]) -> None:
    policy = make_wan_policy(full_finetune=True, reference=True)
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
    assert_fp32_close(ref, before)
    assert not torch.allclose(after, before)
    with pytest.raises(NotImplementedError, match="reference=True"):
        make_wan_policy(full_finetune=True).reference()


def test_bfloat16_weights_give_fp32_velocity(make_wan_policy: Callable[..., WanPolicy]) -> None:
    policy = make_wan_policy(dtype="bfloat16", lora=LoraSpec(rank=4, alpha=4))
    assert policy.weight_dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in policy.trainable_parameters())
    x = policy.initial_noise(1, torch.Generator().manual_seed(0))
    v = policy.velocity(x, torch.full((1,), 0.5), policy.encode(PROMPTS[:1]))
    assert v.dtype == torch.float32 and v.shape == x.shape and torch.isfinite(v).all()
    frames = policy.decode(x.clamp(-1, 1))
    assert frames.shape == (1, WAN_FRAMES, WAN_HEIGHT, WAN_WIDTH, 3)


def test_validation_names_the_field_before_loading(
    tiny_wan_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Frame counts the VAE cannot take and sizes off the 16-pixel grid are validate errors naming the field, found
    from the configs alone: nothing is loaded (from_pretrained would raise) and no tiny model is built."""

    def no_loading(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("validate must not load weights")

    monkeypatch.setattr(WanPipeline, "from_pretrained", no_loading)
    monkeypatch.setattr(wan_module, "ensure_tiny_wan", no_loading)
    monkeypatch.setenv("RLPOST_CACHE", str(tmp_path / "cache"))
    for pretrained in (str(tiny_wan_dir), "tiny-random", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"):
        local = pretrained.startswith("Wan-AI")  # a hub id setup() may download: Wan2.1's own geometry
        kw: dict[str, Any] = {"local_files_only": False} if local else {}
        (frames,) = WanPolicy(pretrained, height=32, width=48, num_frames=8, **kw).validate(None)
        assert frames.startswith("model.init_args.num_frames:") and "1 (mod 4)" in frames and "5 or 9" in frames
        height, width = WanPolicy(pretrained, height=40, width=36, num_frames=9, **kw).validate(None)
        assert height.startswith("model.init_args.height:") and "multiple of 16" in height
        assert width.startswith("model.init_args.width:") and "multiple of 16" in width
        assert WanPolicy(pretrained, height=32, width=48, num_frames=9, **kw).validate(None) == []
    assert not (tmp_path / "cache").exists()
    (zero,) = WanPolicy(str(tiny_wan_dir), num_frames=0, height=32, width=48).validate(None)
    assert zero.startswith("model.init_args.num_frames:")
    (big,) = WanPolicy(str(tiny_wan_dir), height=1024, width=48, num_frames=9).validate(None)
    assert big.startswith("model.init_args.height:") and "rope_max_seq_len 32" in big
    (grid,) = WanPolicy(str(tiny_wan_dir), **SIZE, time_grid="karras").validate(None)  # type: ignore[arg-type]
    assert grid.startswith("model.init_args.time_grid:")
    (cfg,) = problems_of(WanPolicy, "model", pretrained=str(tiny_wan_dir), **SIZE, guidance_scale=math.inf)
    assert cfg == "model.init_args.guidance_scale: must be a finite number, got inf"


def test_setup_refuses_bad_sizes_and_settings(tiny_wan_dir: Path) -> None:
    with pytest.raises(ValueError, match="model.init_args.num_frames"):
        WanPolicy(str(tiny_wan_dir), dtype="float32", height=32, width=48, num_frames=10).setup(torch.device("cpu"))
    with pytest.raises(ValueError, match="model.init_args.width"):
        WanPolicy(str(tiny_wan_dir), dtype="float32", height=32, width=40, num_frames=9).setup(torch.device("cpu"))
    with pytest.raises(ValueError, match="not both"):
        WanPolicy("x", lora=LoraSpec(), full_finetune=True)
    geometry = WanGeometry()  # Wan2.1: 81 frames at 480 x 832 fit; 80 frames or 850 px do not
    assert geometry.problems(480, 832, 81) == [] and geometry.latent_frames(81) == 21
    assert len(geometry.problems(480, 850, 80)) == 2


def test_missing_or_malformed_model_dir(tiny_wan_dir: Path, tmp_path: Path) -> None:
    def setup_error(path: Path | str) -> str:
        with pytest.raises((ModelDirError, OSError)) as info:
            WanPolicy(str(path), **SIZE).setup(torch.device("cpu"))
        return str(info.value)

    assert "does not exist" in setup_error(tmp_path / "nope")
    no_vae = tmp_path / "no_vae"
    shutil.copytree(tiny_wan_dir, no_vae)
    shutil.rmtree(no_vae / "vae")
    assert "vae/" in setup_error(no_vae)
    (problem,) = WanPolicy(str(no_vae), **SIZE).validate(None)
    assert problem.startswith("model.init_args.pretrained:") and "vae/" in problem


def test_tiny_random_id_builds_into_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLPOST_CACHE", str(tmp_path))
    policy = WanPolicy("tiny-random:3", dtype="float32", **SIZE)
    assert policy.validate(None) == [] and policy.clean_tail_steps() == 2
    policy.setup(torch.device("cpu"))
    assert (tmp_path / "tiny-wan-seed3" / "model_index.json").is_file()
    assert type(policy.pipe).__name__ == "WanPipeline"
    assert type(policy.pipe.text_encoder).__name__ == "UMT5EncoderModel"
    assert (policy.pipe.vae_scale_factor_temporal, policy.pipe.vae_scale_factor_spatial) == (4, 8)


def test_registers_through_hook() -> None:
    registered: list[type] = []
    wan_module.rlpost_register_models(registered.append)
    assert registered == [WanPolicy] and WanPolicy.name == "wan" and WanPolicy.kind == "model"
    host = build_host(load_entrypoints=False)  # a built-in model family (rlpost.apps.host.DEFAULT_PLUGINS)
    assert host.registry("model").get("wan").cls is WanPolicy
