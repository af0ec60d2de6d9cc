"""QwenImagePolicy on a tiny real-architecture Qwen-Image pipeline: pipeline equivalence (packing, dynamic shift with
the terminal stretch, true CFG with norm rescaling, the 3-D VAE on one frame), encoding with masks, SDE log-probs,
ratios, LoRA export, reference models, validation and registration as a plugin (mirrors tests/unit/models/
test_flux.py)."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from diffusers import QwenImagePipeline

from rlpost import LoraSpec, StepKernel, make_kernel, pack_latents, shifted_linspace_sigmas, time_shift, unpack_latents
from rlpost_qwenimage.policy import QwenImagePolicy
from tests.argument_checks import problems_of
from tests.tolerances import assert_fp32_close, assert_pixels_close

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = ["a photo of a cat", "two birds in a tree next to a green house"]  # different token counts: padding
NFE = 5
NOISE_OFF: dict[str, dict[str, float]] = {"ode": {}, "flow-sde": {"noise_level": 0.0}, "dance-sde": {"eta": 0.0}}
LATENT_ATOL = 1e-5
"""Adapter vs pipeline latents after NFE Euler steps: the same formulas through separate code (our Euler step and
batched CFG rows vs the scheduler and two forwards), so equal up to fp32 rounding (measured: 0 without guidance,
1e-6 with it); a wrong timestep, shift, mask or guidance formula moves them by 1e-2 or more."""


def _sample(policy: QwenImagePolicy, x: torch.Tensor, prompts: list[str], kernel: StepKernel, nfe: int) -> Any:
    cond = policy.encode(prompts)
    sig = policy.sigmas(nfe)
    b = x.shape[0]
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for i in range(nfe):
            s, sn = sig[i].expand(b), sig[i + 1].expand(b)
            x = kernel.step(x, policy.velocity(x, s, cond), s, sn, gen).next_latents
    return x


def _perturb_lora(policy: QwenImagePolicy, scale: float = 0.5) -> None:
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in policy.transformer.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=g) * scale)


def _dead(policy: QwenImagePolicy, names: Any) -> set[str]:
    """Trainable weights no output depends on: the last block's text-stream output projection and text MLP (only
    the image stream reaches ``proj_out``)."""
    last = f"transformer_blocks.{len(policy.transformer.transformer_blocks) - 1}."
    return {n for n in names if n.startswith((last + "attn.to_add_out.", last + "txt_mlp."))}


def _pipe(directory: Path) -> QwenImagePipeline:
    pipe = QwenImagePipeline.from_pretrained(str(directory), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pipe_run(pipe: QwenImagePipeline, x0: torch.Tensor, prompts: list[str], nfe: int, cfg: float, **kw: Any) -> Any:
    guidance = {"true_cfg_scale": cfg, "negative_prompt": " " if cfg > 1 else None}
    kw = dict(num_inference_steps=nfe, height=32, width=32, max_sequence_length=32) | guidance | kw
    return pipe(prompts, latents=pack_latents(x0.clone()), **kw).images


@pytest.mark.parametrize("cfg", [1.0, 4.0], ids=["no-cfg", "true-cfg"])
@pytest.mark.parametrize("kernel", ["ode", "flow-sde", "dance-sde"])
def test_ode_path_reproduces_the_pipeline(
    make_qwen_policy: Callable[..., QwenImagePolicy], tiny_qwenimage_dir: Path, cfg: float, kernel: str
) -> None:
    """Euler ODE along policy.sigmas (or an SDE kernel with its noise off) equals QwenImagePipeline.__call__ from
    the same noise: latents within LATENT_ATOL, decoded frames within one level."""
    policy = make_qwen_policy(true_cfg_scale=cfg)
    step = make_kernel(kernel, **NOISE_OFF[kernel])
    x0 = policy.initial_noise(2, torch.Generator().manual_seed(0))
    assert x0.shape == (2, 4, 16, 16) and x0.dtype == torch.float32
    ours = _sample(policy, x0, PROMPTS, step, NFE)
    assert policy.forward_count == 2 * NFE  # rows before the guidance doubling
    pipe = _pipe(tiny_qwenimage_dir)
    ref = unpack_latents(_pipe_run(pipe, x0, PROMPTS, NFE, cfg, output_type="latent"), 16, 16)
    assert (ours - ref).abs().max() <= LATENT_ATOL
    assert (ours - x0).abs().max() > 0.1  # the comparison is not vacuous
    if kernel != "ode":
        return
    frames = policy.decode(ours)
    assert policy.frames == 1 and frames.shape == (2, 1, 32, 32, 3) and frames.dtype == torch.uint8
    ref_img = _pipe_run(pipe, x0, PROMPTS, NFE, cfg, output_type="pt")  # [B, 3, H, W] in [0, 1]
    assert_pixels_close(frames[:, 0], (ref_img * 255).round().to(torch.uint8).permute(0, 2, 3, 1))
    # The pipeline drawing its own noise from the same seed: the same images.
    seeded = pipe(
        PROMPTS,
        generator=torch.Generator().manual_seed(0),
        **{"num_inference_steps": NFE, "height": 32, "width": 32, "max_sequence_length": 32, "output_type": "pt"},
        **{"true_cfg_scale": cfg, "negative_prompt": " " if cfg > 1 else None},
    ).images
    assert_pixels_close(frames[:, 0], (seeded * 255).round().to(torch.uint8).permute(0, 2, 3, 1))


def test_guidance_changes_the_velocity_and_forward_count(make_qwen_policy: Callable[..., QwenImagePolicy]) -> None:
    on, off = make_qwen_policy(), make_qwen_policy(true_cfg_scale=1.0)
    assert on.do_cfg and on.true_cfg_scale == 4.0 and not off.do_cfg
    x = on.initial_noise(2, torch.Generator().manual_seed(2))
    s = torch.full((2,), 0.6)
    with torch.no_grad():
        v_on, v_off = on.velocity(x, s, on.encode(PROMPTS)), off.velocity(x, s, off.encode(PROMPTS))
    assert (v_on - v_off).abs().max() > 1e-3
    assert on.forward_count == off.forward_count == 2
    # The pipeline's norm rescaling: each token's guided prediction has the conditional prediction's norm.
    with torch.no_grad():
        tokens_on, tokens_off = pack_latents(v_on), pack_latents(v_off)
    assert_fp32_close(tokens_on.norm(dim=-1), tokens_off.norm(dim=-1))


def test_initial_noise_is_the_pipelines(
    make_qwen_policy: Callable[..., QwenImagePolicy], tiny_qwenimage_dir: Path
) -> None:
    ours = make_qwen_policy().initial_noise(3, torch.Generator().manual_seed(4))
    pipe = _pipe(tiny_qwenimage_dir)
    packed = pipe.prepare_latents(3, 4, 32, 32, torch.float32, "cpu", torch.Generator().manual_seed(4))
    assert torch.equal(pack_latents(ours), packed)


def test_sigmas_dynamic_shift_and_terminal(
    make_qwen_policy: Callable[..., QwenImagePolicy], tiny_qwenimage_dir: Path
) -> None:
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    policy = make_qwen_policy()
    assert policy.image_seq_len == 64
    assert policy.mu == pytest.approx(calculate_shift(64, 256, 8192, 0.5, 0.9), abs=1e-12)
    pipe = _pipe(tiny_qwenimage_dir)
    x0 = policy.initial_noise(1, torch.Generator().manual_seed(0))
    _pipe_run(pipe, x0, PROMPTS[:1], 7, 1.0, output_type="latent")
    assert torch.equal(policy.sigmas(7), pipe.scheduler.sigmas)  # the pipeline's own scheduler, bit for bit
    # Independently: the exponential shift with mu is the static shift s = e^mu, then the grid is stretched so that
    # its last nonzero level is shift_terminal: 1 - σ -> (1 - σ)·(1 - 0.02)/(1 - σ_last).
    shifted = time_shift(torch.linspace(1, 1 / 7, 7, dtype=torch.float64), math.exp(policy.mu))
    stretched = 1 - (1 - shifted) * (1 - 0.02) / (1 - shifted[-1])
    assert_fp32_close(policy.sigmas(7), torch.cat([stretched, torch.zeros(1, dtype=torch.float64)]).float())
    assert float(policy.sigmas(7)[-2]) == pytest.approx(0.02)
    static = make_qwen_policy(time_grid="shifted-linspace")
    assert torch.equal(static.sigmas(7), shifted_linspace_sigmas(7, 1.0))  # the config's static shift: 1
    three = make_qwen_policy(time_grid="shifted-linspace", shift=3.0)
    assert torch.equal(three.sigmas(3), shifted_linspace_sigmas(3, 3.0))
    assert policy.clean_tail_steps() == 2 and static.clean_tail_steps() == 1


def test_encode_is_cached_per_prompt_with_masks(
    make_qwen_policy: Callable[..., QwenImagePolicy], monkeypatch: pytest.MonkeyPatch
) -> None:
    policy = make_qwen_policy()
    calls: list[list[str]] = []
    real = policy.pipe.encode_prompt

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(list(kwargs["prompt"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(policy.pipe, "encode_prompt", spy)
    c1 = policy.encode([PROMPTS[0], PROMPTS[1], PROMPTS[0]])
    c2 = policy.encode([PROMPTS[0]])
    assert calls == [[PROMPTS[0], PROMPTS[1], " "]]  # the negative prompt is one more cached prompt
    t1, t2 = c1.tensors, c2.tensors
    assert set(t1) == {"prompt_embeds", "prompt_embeds_mask", "negative_prompt_embeds", "negative_prompt_embeds_mask"}
    n0, n1 = (int(m.sum()) for m in t1["prompt_embeds_mask"][:2])
    assert n0 < n1 == t1["prompt_embeds"].shape[1] and t2["prompt_embeds"].shape[1] == n0  # padded to the longest
    # Each row is the pipeline's own embedding of that prompt alone, template tokens dropped, padding zero.
    alone, mask = real(prompt=[PROMPTS[0]], device="cpu", max_sequence_length=32)
    assert mask is None and alone.shape[1] == n0
    assert_fp32_close(t1["prompt_embeds"][0, :n0], alone[0])
    assert not t1["prompt_embeds"][0, n0:].any()
    assert torch.equal(t1["prompt_embeds"][0, :n0], t2["prompt_embeds"][0])
    # A row's velocity does not depend on the other prompts of its batch (their padding is masked).
    x = policy.initial_noise(3, torch.Generator().manual_seed(1))
    s = torch.full((1,), 0.7)
    with torch.no_grad():
        v_batch = policy.velocity(x[:1], s, c1.select(torch.tensor([0])))
        v_alone = policy.velocity(x[:1], s, c2)
    assert_fp32_close(v_batch, v_alone)


@pytest.mark.parametrize("kernel", ["dance-sde", "flow-sde"])
def test_sde_log_prob_is_an_independent_gaussian_density(
    make_qwen_policy: Callable[..., QwenImagePolicy], kernel: str
) -> None:
    """The kernel's log-prob of a Qwen-Image step equals torch.distributions.Normal's density at the mean and std
    written out here from the papers' formulas (DanceGRPO flux_step; Flow-GRPO eq. 9-10), averaged over latent
    elements."""
    policy = make_qwen_policy()
    step = make_kernel(kernel, **({"eta": 0.3} if kernel == "dance-sde" else {"noise_level": 0.7}))
    cond = policy.encode(PROMPTS)
    sig = policy.sigmas(4)
    x = policy.initial_noise(2, torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for i in range(3):
            s, sn = sig[i].expand(2), sig[i + 1].expand(2)
            v = policy.velocity(x, s, cond)
            out = step.step(x, v, s, sn, gen)
            si, sni = float(sig[i]), float(sig[i + 1])
            dt = sni - si
            if kernel == "dance-sde":
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
            x = out.next_latents


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_recomputed_log_prob_gives_ratio_one(make_qwen_policy: Callable[..., QwenImagePolicy], lora: bool) -> None:
    """Before any update, exp(logp_new - logp_old) == 1 up to fp32 rounding (XueZeyue/DanceGRPO issue #87), the
    recomputation running with gradients (LoRA with gradient checkpointing, and full fine-tuning); gradients reach the
    trained weights."""
    kw: dict[str, Any] = (
        {"lora": LoraSpec(rank=4, alpha=4), "gradient_checkpointing": True} if lora else {"full_finetune": True}
    )
    policy = make_qwen_policy(**kw)
    if lora:
        _perturb_lora(policy)
    step = make_kernel("flow-sde", noise_level=0.7)
    cond = policy.encode(PROMPTS)
    sig = policy.sigmas(4)
    x = policy.initial_noise(2, torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    stored = []
    policy.train(False)
    with torch.no_grad():
        for i in range(3):
            s, sn = sig[i].expand(2), sig[i + 1].expand(2)
            out = step.step(x, policy.velocity(x, s, cond), s, sn, gen)
            stored.append((x, s, sn, out.next_latents, out.log_prob))
            x = out.next_latents
    policy.train(True)
    for x_i, s, sn, nxt, old in stored:
        mean, std = step.mean_std(x_i, policy.velocity(x_i, s, cond), s, sn)
        new = step.log_prob(nxt, mean, std)
        assert new.requires_grad
        ratio = torch.exp(new - old)
        assert torch.allclose(ratio, torch.ones_like(ratio), rtol=0, atol=1e-6), ratio
        new.sum().backward()
    grads = {n: p.grad for n, p in policy.transformer.named_parameters() if p.requires_grad}
    assert len(grads) == len(policy.trainable_parameters())
    assert {n for n, g in grads.items() if g is None} == _dead(policy, grads)
    assert sum(1 for g in grads.values() if g is not None and float(g.abs().max()) > 0) > len(grads) // 2


def test_lora_gradients_only_reach_adapter(make_qwen_policy: Callable[..., QwenImagePolicy]) -> None:
    policy = make_qwen_policy(lora=LoraSpec(rank=4, alpha=8))
    _perturb_lora(policy)
    names = {n for n, p in policy.transformer.named_parameters() if p.requires_grad}
    assert names and all("lora_" in n for n in names)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in names} >= {"to_q", "add_q_proj", "to_add_out"}
    x = policy.initial_noise(2, torch.Generator().manual_seed(0))
    policy.train(True)
    policy.velocity(x, torch.full((2,), 0.7), policy.encode(PROMPTS)).square().mean().backward()
    dead = _dead(policy, names)
    assert dead and len(dead) < len(names)
    for n, p in policy.transformer.named_parameters():
        assert (p.grad is not None) == ("lora_" in n and n not in dead), n
    for m in (policy.pipe.text_encoder, policy.pipe.vae):
        assert all(p.grad is None and not p.requires_grad for p in m.parameters())


def test_saved_lora_reproduces_sampling_in_diffusers(
    make_qwen_policy: Callable[..., QwenImagePolicy], tiny_qwenimage_dir: Path, tmp_path: Path
) -> None:
    policy = make_qwen_policy(lora=LoraSpec(rank=4, alpha=8))
    x0 = policy.initial_noise(2, torch.Generator().manual_seed(3))
    ode = make_kernel("ode")
    base = _sample(policy, x0, PROMPTS, ode, 3)
    _perturb_lora(policy)
    trained = _sample(policy, x0, PROMPTS, ode, 3)
    assert (trained - base).abs().max() > 1e-3  # the adapter has an effect
    out = policy.save_lora(tmp_path / "lora")
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    pipe = _pipe(tiny_qwenimage_dir)
    pipe.load_lora_weights(str(out))
    ref = unpack_latents(_pipe_run(pipe, x0, PROMPTS, 3, 4.0, output_type="latent"), 16, 16)
    assert (ref - trained).abs().max() <= LATENT_ATOL  # alpha/rank restored from the stored adapter metadata
    ref_img = _pipe_run(pipe, x0, PROMPTS, 3, 4.0, output_type="pt")
    assert_pixels_close(policy.decode(trained)[:, 0], (ref_img * 255).round().to(torch.uint8).permute(0, 2, 3, 1))


def test_lora_reference_disables_adapter(make_qwen_policy: Callable[..., QwenImagePolicy]) -> None:
    policy = make_qwen_policy(lora=LoraSpec(rank=4, alpha=8))
    frozen = make_qwen_policy()
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


def test_full_finetune_reference_copy(make_qwen_policy: Callable[..., QwenImagePolicy]) -> None:
    policy = make_qwen_policy(full_finetune=True, reference=True)
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
        make_qwen_policy(full_finetune=True).reference()
    assert make_qwen_policy().trainable_parameters() == []


def test_bfloat16_weights_give_fp32_velocity(make_qwen_policy: Callable[..., QwenImagePolicy]) -> None:
    policy = make_qwen_policy(dtype="bfloat16", lora=LoraSpec(rank=4, alpha=4))
    assert policy.weight_dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in policy.trainable_parameters())
    x = policy.initial_noise(1, torch.Generator().manual_seed(0))
    v = policy.velocity(x, torch.full((1,), 0.5), policy.encode(PROMPTS[:1]))
    assert v.dtype == torch.float32 and v.shape == x.shape and torch.isfinite(v).all()
    frames = policy.decode(x)
    assert frames.shape == (1, 1, 32, 32, 3) and frames.dtype == torch.uint8


def test_validate_names_the_field_before_any_weight_loads(
    tiny_qwenimage_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLPOST_CACHE", str(tmp_path / "cache"))

    def no_loading(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("validate() loaded a pipeline")

    monkeypatch.setattr(QwenImagePipeline, "from_pretrained", no_loading)
    # The tiny VAE factor 2 x 2x2 packing: a multiple of 4, for a local directory and for the tiny id.
    for source in (str(tiny_qwenimage_dir), "tiny-random"):
        (bad,) = QwenImagePolicy(source, resolution=30).validate(None)
        assert bad.startswith("model.init_args.resolution:") and "multiple of 4" in bad, bad
        assert QwenImagePolicy(source, resolution=32).validate(None) == []
    assert not (tmp_path / "cache").exists()  # the tiny id was not built either
    # Read from the model's own VAE config: the released VAE's three down stages make it a multiple of 16.
    released = tmp_path / "released"
    shutil.copytree(tiny_qwenimage_dir, released)
    vae_config = json.loads((released / "vae" / "config.json").read_text())
    (released / "vae" / "config.json").write_text(json.dumps(vae_config | {"temperal_downsample": [False, True, True]}))
    (bad,) = QwenImagePolicy(str(released), resolution=520).validate(None)
    assert bad.startswith("model.init_args.resolution:") and "multiple of 16" in bad, bad
    refused = {"max_sequence_length": 2000, "true_cfg_scale": math.nan}  # outside the declared ranges
    for field, value in refused.items():
        (problem,) = problems_of(QwenImagePolicy, "model", pretrained=str(tiny_qwenimage_dir), **{field: value})
        assert problem.startswith(f"model.init_args.{field}: must be"), problem
    problems = {
        "shift": QwenImagePolicy(str(tiny_qwenimage_dir), resolution=32, shift=3.0),
        "time_grid": QwenImagePolicy(str(tiny_qwenimage_dir), resolution=32, time_grid="karras"),  # type: ignore[arg-type]
        "pretrained": QwenImagePolicy(str(tmp_path / "nope"), resolution=32),
    }
    for field, policy in problems.items():
        (problem,) = policy.validate(None)
        assert problem.startswith(f"model.init_args.{field}:"), problem
    assert "does not exist" in problems["pretrained"].validate(None)[0]
    ok = QwenImagePolicy(str(tiny_qwenimage_dir), resolution=32, time_grid="shifted-linspace", shift=3.0)
    assert ok.validate(None) == []
    with pytest.raises(ValueError, match="not both"):
        QwenImagePolicy("x", lora=LoraSpec(), full_finetune=True)


def test_setup_checks_the_loaded_model(tiny_qwenimage_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        QwenImagePolicy(str(tiny_qwenimage_dir), resolution=30, dtype="float32").setup(torch.device("cpu"))
    no_te = tmp_path / "no_te"
    shutil.copytree(tiny_qwenimage_dir, no_te)
    shutil.rmtree(no_te / "text_encoder")
    with pytest.raises(OSError, match="text_encoder/"):
        QwenImagePolicy(str(no_te), resolution=32).setup(torch.device("cpu"))
    (problem,) = QwenImagePolicy(str(no_te), resolution=32).validate(None)
    assert problem.startswith("model.init_args.pretrained:") and "text_encoder/" in problem


def test_tiny_random_id_builds_into_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLPOST_CACHE", str(tmp_path))
    policy = QwenImagePolicy("tiny-random:3", resolution=32, dtype="float32", max_sequence_length=8)
    policy.setup(torch.device("cpu"))
    assert (tmp_path / "tiny-qwenimage-seed3" / "model_index.json").is_file()
    assert type(policy.pipe).__name__ == "QwenImagePipeline"
    assert policy.latent_shape == (4, 16, 16)


def test_registers_as_a_plugin_and_validates_in_a_recipe(
    qwen_host: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The family is a plugin: the host registers ``qwen-image`` from rlpost_qwenimage, and a DanceGRPO recipe on it
    validates (the sampler's clean-tail check asks the adapter) or names the bad field, building nothing."""
    from rlpost.engine.recipe import RecipeError, validate

    entry = qwen_host.registry("model").get("qwen-image")
    assert entry.cls is QwenImagePolicy and QwenImagePolicy.kind == "model"
    monkeypatch.setenv("RLPOST_CACHE", str(tmp_path / "cache"))
    recipe = yaml.safe_load((ROOT / "recipes" / "tiny" / "dancegrpo.yaml").read_text())
    model = {"pretrained": "tiny-random", "resolution": 32, "dtype": "float32", "max_sequence_length": 32}
    recipe["model"] = {"class_path": "qwen-image", "init_args": model | {"lora": {"rank": 4, "alpha": 8}}}
    built = validate(recipe, qwen_host)
    assert isinstance(built.model, QwenImagePolicy) and built.model.true_cfg_scale == 4.0
    recipe["model"]["init_args"]["resolution"] = 30
    with pytest.raises(RecipeError, match=r"model\.init_args\.resolution: 30 is not a multiple of 4"):
        validate(recipe, qwen_host)
    recipe["model"]["init_args"]["resolution"] = 32
    recipe["sampler"]["init_args"]["penultimate_step"] = "sde"  # sampled noise into the 0.02 level: refused
    with pytest.raises(RecipeError, match="penultimate_step"):
        validate(recipe, qwen_host)
    assert not (tmp_path / "cache").exists()
