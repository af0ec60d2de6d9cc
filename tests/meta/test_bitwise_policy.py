"""Every bitwise assertion in tests/ relies on a documented guarantee (tests must pass on any CPU type).

Float kernels round differently across CPU types and memory alignments (``docs/design.md``, "Determinism"), so a
test may assert bit-for-bit equality only where the project promises it. This test scans tests/ for bitwise
comparisons (``torch.equal``, ``np.array_equal``, ``atol=0``, byte or hash comparisons, exact-zero checks, float
``.tolist() ==``) and fails unless each one is listed in ``ALLOWED`` with the guarantee it relies on; each guarantee
names the doc that promises it, and that promise must still be written there. Anything else compares with a
tolerance (``tests/tolerances.py``). Negated comparisons (``not torch.equal``: "this changed") are not bitwise
claims and are not listed: rounding cannot make them fail.

To add a bitwise assertion: make sure one of ``GUARANTEES`` covers it (or document a new guarantee first), then add
``(path, stripped line)`` to ``ALLOWED``.
"""

# ruff: noqa: E501  (ALLOWED quotes source lines verbatim)
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# guarantee -> (doc that promises it, a phrase of that promise, whitespace-normalised)
GUARANTEES: dict[str, tuple[str, str]] = {
    "one-machine": (
        "docs/design.md",
        "the same computation on the same inputs in one process gives the same bits, so a seed reproduces its random "
        "draws and a re-run",
    ),
    "resume": ("docs/checkpoints.md", "N steps equal k steps + resume + (N−k) steps bitwise on CPU (on one machine"),
    "no-arithmetic": (
        "docs/design.md",
        "Values that are copied, cached, serialised or masked (no float arithmetic between the two sides) and integer "
        "and boolean tensors are exact everywhere",
    ),
    "schedules": (
        "docs/models.md",
        "`sd3_sigmas` equals `FlowMatchEulerDiscreteScheduler(shift=s).set_timesteps(T).sigmas` bit for bit",
    ),
    "flux-schedules": ("docs/models.md", "`sigmas(T)` equals the pipeline scheduler's sigmas bit for bit"),
    "zero-advantage": ("docs/rewards.md", "A singleton or constant group gives **exactly 0**"),
    "distributed": ("docs/distributed.md", "The result equals the single-rank one exactly"),
    "log-prob": ("docs/design.md", "keeps the log-prob function identical at both ends"),
    "one-frame": (
        "docs/rewards.md",
        "with any reduction an image model's scores are its images' scores bit for bit",
    ),
}

# (path, stripped line) -> guarantee. One entry covers every identical line of that file.
ALLOWED: dict[tuple[str, str], str] = {
    # rlpost sample of one checkpoint twice in one process (before and after the run lost its reward plugin)
    (
        "tests/unit/test_cli_ux.py",
        "assert len(after) == 2 and all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))",
    ): "one-machine",
    # AWM: resume with the ema copy; a micro-batch's shared levels are one value copied; the same keyed draws and the
    # same renoise of the same micro-batch on a 1- and a 2-rank split, in one process; skipped steps touch nothing
    (
        "tests/plugins/awm/test_runs.py",
        'assert torch.equal(a, b), "weights must be bitwise equal after resume"',
    ): "resume",
    (
        "tests/plugins/awm/test_runs.py",
        'assert torch.equal(a, b), "the ema copy must be bitwise equal after resume"',
    ): "resume",
    ("tests/plugins/awm/test_update.py", "assert torch.equal(per_stratum[:, 0], per_stratum[:, 1])"): "no-arithmetic",
    ("tests/plugins/awm/test_update.py", "assert torch.equal(s_a, s_b) and torch.equal(x_a, x_b)"): "one-machine",
    (
        "tests/plugins/awm/test_update.py",
        "assert all(torch.equal(p, b) for p, b in zip(policy.trainable_parameters(), before, strict=True))",
    ): "no-arithmetic",
    # DGPO on the tiny SD3: a resumed run equals the uninterrupted one, its ema_ref copy included
    (
        "tests/plugins/dgpo/test_run.py",
        'assert torch.equal(x, y), "the ema_ref copy must be bitwise equal after resume"',
    ): "resume",
    (
        "tests/plugins/dgpo/test_run.py",
        'assert torch.equal(x, y), "weights must be bitwise equal after resume"',
    ): "resume",
    (
        "tests/unit/test_likelihood_free_example.py",
        'assert torch.equal(x, y), "the old copy must be bitwise equal after resume"',
    ): "resume",
    (
        "tests/unit/test_likelihood_free_example.py",
        'assert torch.equal(x, y), "weights must be bitwise equal after resume"',
    ): "resume",
    # weight copies and training noise: copies swapped in/out and serialised; keyed draws re-made in one process
    (
        "tests/unit/ops/test_training_noise.py",
        "assert torch.equal(a, torch.rand(4, generator=keyed_generator(3, 1, 2)))  # a stateless function of its keys",
    ): "one-machine",
    (
        "tests/unit/ops/test_training_noise.py",
        "assert torch.equal(grid_permutations(5, 2, keys[2:], 10, 9), perm[2:])  # the other rank's samples, alone",
    ): "no-arithmetic",
    (
        "tests/unit/ops/test_training_noise.py",
        "assert torch.equal(e1, noise_for(0, 3, (2, 1), (2, 4)))",
    ): "one-machine",
    (
        "tests/unit/test_weight_copies.py",
        'assert all(torch.equal(s, p) for s, p in zip(copies.shadows["old"], start, strict=True))',
    ): "no-arithmetic",
    (
        "tests/unit/test_weight_copies.py",
        "assert torch.equal(params[0], torch.full_like(params[0], 7.0))",
    ): "no-arithmetic",
    (
        "tests/unit/test_weight_copies.py",
        "assert all(torch.equal(p, w) for p, w in zip(params, live, strict=True))",
    ): "no-arithmetic",
    (
        "tests/unit/test_weight_copies.py",
        "assert torch.equal(a, b)  # checkpoints restore copies bit for bit (resume within one process)",
    ): "no-arithmetic",
    # the digits judge: the same training (or augmentation) run twice in one process
    (
        "tests/unit/digits/test_digits.py",
        "assert all(torch.equal(sa[k], sb[k]) for k in sa)",
    ): "one-machine",
    (
        "tests/unit/digits/test_digits.py",
        "assert torch.equal(a, b)",
    ): "one-machine",
    # integer / boolean tensors
    # a velocity kept from a CUDA graph replay against its own copy: a later replay must not overwrite it
    (
        "tests/gpu/test_speedups.py",
        "torch.testing.assert_close(first, kept, rtol=0, atol=0)",
    ): "no-arithmetic",
    # the ratio guard leaves the run's generators untouched: their states are byte tensors
    (
        "tests/unit/test_ratio_guard.py",
        "assert torch.equal(a.pop(key), b.pop(key)), key",
    ): "no-arithmetic",
    # the loss guard leaves the run's generators untouched (byte tensors) and trains nothing (weights untouched)
    (
        "tests/unit/test_loss_guard.py",
        "assert torch.equal(a.pop(key), b.pop(key)), key",
    ): "no-arithmetic",
    (
        "tests/unit/test_loss_guard.py",
        "assert weight.grad is None and torch.equal(weight, torch.ones(3))",
    ): "no-arithmetic",
    # two runners built alike in one process, one of which ran the loss guard: the same weights and copies
    (
        "tests/unit/test_loss_guard.py",
        "assert torch.equal(x, y)",
    ): "one-machine",
    (
        "tests/unit/test_loss_guard.py",
        'assert all(torch.equal(copies_a["old"][k], copies_b["old"][k]) for k in copies_a["old"])',
    ): "one-machine",
    # bypassed speed-ups: the same eager computation as without them, in one process
    (
        "tests/unit/models/test_acceleration.py",
        "assert out.dtype == torch.float32 and torch.equal(out, module.lin(x))",
    ): "one-machine",
    (
        "tests/unit/models/test_acceleration.py",
        "assert torch.equal(bypassed, reference)",
    ): "one-machine",
    # the conformance kit restores the trainable weights it changed (copies back)
    (
        "tests/unit/testing/test_checks.py",
        "assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))  # the check restores the weights",
    ): "no-arithmetic",
    # EMA: a skipped update, a swap and a state round-trip copy tensors (no arithmetic between the two sides)
    (
        "tests/unit/test_ema.py",
        "assert all(torch.equal(a, b) for a, b in zip(start, ema.shadow, strict=True))",
    ): "no-arithmetic",
    (
        "tests/unit/test_ema.py",
        "assert torch.equal(p.detach(), s)",
    ): "no-arithmetic",
    (
        "tests/unit/test_ema.py",
        "assert torch.equal(p.detach(), before)",
    ): "no-arithmetic",
    (
        "tests/unit/test_ema.py",
        "assert all(torch.equal(a, b) for a, b in zip(ema.shadow, other.shadow, strict=True))",
    ): "no-arithmetic",
    (
        "tests/plugins/rewards/test_imagereward.py",
        "assert torch.equal(a.head.layers[7].weight, b.head.layers[7].weight)",
    ): "no-arithmetic",
    # a step skipped for a non-finite gradient leaves the weights untouched
    (
        "tests/unit/test_update_result.py",
        "assert backend.skipped_steps == 1 and torch.equal(theta.detach(), before)",
    ): "no-arithmetic",
    (
        "tests/plugins/rewards/test_openclip_rewards.py",
        "assert torch.equal(pixels[..., :8], torch.zeros(1, 3, 32, 8)) and torch.equal(pixels[..., 24:], pixels[..., :8])",
    ): "no-arithmetic",
    (
        "tests/plugins/treegrpo/test_window.py",
        'assert torch.equal(gen.get_state(), before), "the progressive schedule draws nothing"',
    ): "no-arithmetic",
    (
        "tests/plugins/dancegrpo/test_dancegrpo.py",
        "assert torch.equal(plan.trainable.sum(1), torch.full((64,), 4))",
    ): "no-arithmetic",
    (
        "tests/plugins/flowgrpo/test_sampler.py",
        "assert torch.equal(rollout.trainable, window)",
    ): "no-arithmetic",
    (
        "tests/plugins/flowgrpo/test_sampler.py",
        "assert torch.equal(rollout.edge_kernel == 0, window)  # SDE inside the window, ODE outside",
    ): "no-arithmetic",
    (
        "tests/plugins/flowgrpo/test_sampler.py",
        "assert torch.equal(rollout.trainable, steps < sampler.train_steps)",
    ): "no-arithmetic",
    (
        "tests/plugins/flowgrpo/test_sampler.py",
        "assert torch.equal(roots[0], roots[1]) and not torch.equal(roots[0], roots[2])",
    ): "no-arithmetic",
    (
        "tests/plugins/flowgrpo/test_sampler.py",
        "assert torch.equal(together.edge_step[rows & together.trainable], part.edge_step[part.trainable])",
    ): "no-arithmetic",
    (
        "tests/plugins/mixgrpo/test_mixgrpo.py",
        "assert torch.equal(rollout.trainable, (steps >= expected_start) & (steps < expected_start + 2))",
    ): "no-arithmetic",
    (
        "tests/plugins/treegrpo/test_sampler.py",
        "assert torch.equal(torch.unique(rollout.edge_step[rollout.trainable]), torch.arange(start, start + depth))",
    ): "no-arithmetic",
    (
        "tests/plugins/treegrpo/test_sampler.py",
        "assert torch.equal(rollout.children_count()[rollout.sample_node], torch.zeros(c.images, dtype=torch.long))",
    ): "no-arithmetic",
    (
        "tests/plugins/treegrpo/test_sampler.py",
        "assert torch.equal(torch.bincount(rollout.sample_group), torch.full((g,), trees * k**depth))",
    ): "no-arithmetic",
    (
        "tests/plugins/treegrpo/test_sampler.py",
        "assert together.sample_group.tolist() == alone.sample_group.tolist()",
    ): "no-arithmetic",
    (
        "tests/unit/components/test_chain.py",
        "assert together.sample_group.tolist() == alone.sample_group.tolist()",
    ): "no-arithmetic",
    # scores parsed from a canned JSON answer (serialised values, no arithmetic)
    (
        "tests/plugins/rewards/test_remote.py",
        'assert remote.score(make_images(2, size=8), ["a", "b"], [{}, {}]).tolist() == [1.0, 2.0]',
    ): "no-arithmetic",
    # a checkpoint file re-hashed so the integrity check passes (a digest is assigned, nothing compared)
    (
        "tests/unit/test_hostile_cli.py",
        'manifest["files"]["state.json"] = hashlib.sha256(text.encode()).hexdigest()  # the integrity check passes',
    ): "no-arithmetic",
    (
        "tests/unit/test_run_integrity.py",
        'manifest["files"][name] = hashlib.sha256(text.encode()).hexdigest()',
    ): "no-arithmetic",
    (
        "tests/unit/test_overlap.py",
        'assert merged.num_samples == 3 and scores.scores["r"].tolist() == [1.0, 1.0, 1.0]',
    ): "no-arithmetic",
    (
        "tests/plugins/treegrpo/test_tail.py",
        "assert ref.trainable.nonzero().tolist() == got.trainable.nonzero().tolist()  # tails are appended after the window",
    ): "no-arithmetic",
    (
        "tests/unit/components/test_group_zscore.py",
        "assert torch.equal(torch.bincount(owner, minlength=6), torch.full((6,), 4))  # every chain has T edges",
    ): "no-arithmetic",
    (
        "tests/unit/test_checkpoint.py",
        'assert state["step"] == 3 and torch.equal(state["x"], torch.arange(4))',
    ): "no-arithmetic",
    # copies, caches, serialisation round trips, masked zeros
    (
        "tests/plugins/dancegrpo/test_dancegrpo.py",
        "assert torch.equal(roots[0], roots[2]) and not torch.equal(roots[0], roots[3])  # init_same_noise per group",
    ): "no-arithmetic",
    (
        "tests/plugins/ddpo/test_ddpo.py",
        "assert torch.equal(adv.edges[~rollout.trainable], torch.zeros(4))",
    ): "no-arithmetic",
    (
        "tests/plugins/rewards/test_hf_clip_rewards.py",
        "assert torch.equal(loaded.layers[7].weight, head.layers[7].weight)",
    ): "no-arithmetic",
    (
        "tests/plugins/treegrpo/test_advantage.py",
        "assert out.edges[~r.trainable].abs().max() == 0  # trunk and tail edges: advantage 0",
    ): "no-arithmetic",
    ("tests/plugins/treegrpo/test_advantage.py", "assert total.edges[~r.trainable].abs().max() == 0"): "no-arithmetic",
    (
        "tests/plugins/tempflow/test_advantage.py",
        "assert steps.tolist() == [[[j] * 6 for j in range(3)]] * 2  # integer step indices",
    ): "no-arithmetic",
    (
        "tests/unit/models/test_sd3.py",
        'assert torch.equal(c1.tensors["prompt_embeds"][0], c2.tensors["prompt_embeds"][2])',
    ): "no-arithmetic",
    (
        "tests/unit/models/test_sd3.py",
        'assert torch.equal(sel.tensors["prompt_embeds"][0], c2.tensors["prompt_embeds"][1])',
    ): "no-arithmetic",
    (
        "tests/unit/test_checkpoint.py",
        'assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])',
    ): "no-arithmetic",
    ("tests/unit/test_checkpoint.py", 'assert np.array_equal(back["numpy"][1], state["numpy"][1])'): "no-arithmetic",
    ("tests/unit/test_checkpoint.py", 'assert torch.equal(back["gen"], state["gen"])'): "no-arithmetic",
    (
        "tests/unit/test_checkpoint.py",
        'assert torch.equal(weights["trainable.0000"], torch.ones(2, 3)) and ema is None',
    ): "no-arithmetic",
    # the same computation on the same inputs in one process (same seed, same objects); the conformance kit's
    # determinism checks (rlpost/testing: same_state) rest on the same guarantee
    (
        "tests/plugins/treegrpo/test_sampler.py",
        'assert torch.equal(a.states, b.states) and a.stats["tree/window_start"] == b.stats["tree/window_start"]',
    ): "one-machine",
    (
        "tests/unit/digits/test_digits.py",
        'assert (out / weights).read_bytes() == (tmp_path / "again" / weights).read_bytes()',
    ): "one-machine",
    ("tests/unit/models/test_sd3.py", "assert torch.equal(a, b)"): "one-machine",
    ("tests/unit/models/test_tiny.py", "assert all(torch.equal(a[k], b[k]) for k in a)"): "one-machine",
    ("tests/unit/ops/test_kernels.py", "assert torch.equal(a.next_latents, b.next_latents)"): "one-machine",
    ("tests/unit/ops/test_kernels.py", "assert torch.equal(again, nxt)"): "one-machine",
    # rollout and recomputation share one log-prob function
    (
        "tests/unit/ops/test_kernels.py",
        "assert torch.equal(kernel.log_prob(out.next_latents, out.mean, out.std, reduction), out.log_prob)  # type: ignore[arg-type]",
    ): "log-prob",
    # schedules equal diffusers' bit for bit (same arithmetic)
    ("tests/unit/models/test_sd3.py", "assert torch.equal(policy.sigmas(10), sd3_sigmas(10, 3.0))"): "schedules",
    # FLUX: packing is views and permutes; the adapter's noise is the pipeline's draw, reshaped; FluxPolicy.sigmas
    # hands linspace to the pipeline's own scheduler class; cached prompt rows are copies
    (
        "tests/unit/models/test_flux.py",
        "assert torch.equal(packed, FluxPipeline._pack_latents(x, 2, 4, 8, 6))",
    ): "no-arithmetic",
    ("tests/unit/models/test_flux.py", "assert torch.equal(unpack_latents(packed, 8, 6), x)"): "no-arithmetic",
    (
        "tests/unit/models/test_flux.py",
        "assert torch.equal(FluxPipeline._unpack_latents(packed, 16, 12, 2), x)",
    ): "no-arithmetic",
    ("tests/unit/models/test_flux.py", "assert torch.equal(pack_latents(ours), packed)"): "one-machine",
    ("tests/unit/models/test_flux.py", "assert torch.equal(policy.sigmas(7), pipe.scheduler.sigmas)"): "flux-schedules",
    (
        "tests/unit/models/test_flux.py",
        "assert torch.equal(static.sigmas(7), shifted_linspace_sigmas(7, 3.0))  # the config's shift, DanceGRPO's 3",
    ): "one-machine",
    (
        "tests/unit/models/test_flux.py",
        "assert torch.equal(two.sigmas(3), shifted_linspace_sigmas(3, 2.0))",
    ): "one-machine",
    (
        "tests/unit/models/test_flux.py",
        'assert torch.equal(c1.tensors["prompt_embeds"][0], c2.tensors["prompt_embeds"][2])',
    ): "no-arithmetic",
    # velocity(guidance=None) runs the same computation as the call without it (docs/models.md "Guidance per call")
    (
        "tests/unit/models/test_guidance.py",
        "assert torch.equal(policy.velocity(x, SIGMA, cond, guidance=None), v)  # the same computation, one process",
    ): "one-machine",
    (
        "tests/plugins/qwenimage/test_guidance.py",
        "assert torch.equal(policy.velocity(x, SIGMA, cond, guidance=None), v)  # the same computation, one process",
    ): "one-machine",
    # Qwen-Image (plugins/rlpost_qwenimage): the same packing, noise draw and scheduler hand-over as FLUX (the
    # adapter calls the facade's pack_latents / flux_sigmas); cached prompt rows are copies; the tiny build is seeded
    ("tests/plugins/qwenimage/test_qwenimage.py", "assert torch.equal(pack_latents(ours), packed)"): "one-machine",
    (
        "tests/plugins/qwenimage/test_qwenimage.py",
        "assert torch.equal(policy.sigmas(7), pipe.scheduler.sigmas)  # the pipeline's own scheduler, bit for bit",
    ): "flux-schedules",
    (
        "tests/plugins/qwenimage/test_qwenimage.py",
        "assert torch.equal(static.sigmas(7), shifted_linspace_sigmas(7, 1.0))  # the config's static shift: 1",
    ): "one-machine",
    (
        "tests/plugins/qwenimage/test_qwenimage.py",
        "assert torch.equal(three.sigmas(3), shifted_linspace_sigmas(3, 3.0))",
    ): "one-machine",
    (
        "tests/plugins/qwenimage/test_qwenimage.py",
        'assert torch.equal(t1["prompt_embeds"][0, :n0], t2["prompt_embeds"][0])',
    ): "no-arithmetic",
    ("tests/plugins/qwenimage/test_tiny.py", "assert all(torch.equal(a[k], b[k]) for k in a)"): "one-machine",
    ("tests/unit/ops/test_schedules.py", "assert torch.equal(ours, sched.sigmas)"): "schedules",
    (
        "tests/unit/ops/test_schedules.py",
        "assert torch.equal(timesteps_from_sigmas(ours[:-1]), sched.timesteps)",
    ): "schedules",
    # constant reward groups give exactly zero advantage
    (
        "tests/plugins/treegrpo/test_advantage.py",
        "assert out.samples[6:].abs().max() == 0  # equal rewards: zero advantage, never NaN",
    ): "zero-advantage",
    (
        "tests/unit/components/test_group_zscore.py",
        "assert torch.equal(adv.samples[[0, 1, 2, 6, 7, 8]], torch.zeros(6))",
    ): "zero-advantage",
    (
        "tests/unit/components/test_group_zscore.py",
        "assert torch.equal(adv.edges[edge_sample_ids(rollout) < 3], torch.zeros(6))",
    ): "zero-advantage",
    (
        "tests/unit/ops/test_zscore_properties.py",
        "assert torch.count_nonzero(out.samples) == 0, (case.name, const, out.samples.abs().max())",
    ): "zero-advantage",
    (
        "tests/unit/ops/test_zscore_properties.py",
        "assert torch.count_nonzero(out.edges) == 0, (case.name, const, out.edges.abs().max())",
    ): "zero-advantage",
    (
        "tests/unit/ops/test_zscore_properties.py",
        "assert torch.count_nonzero(out.samples[flat]) == 0, case.name",
    ): "zero-advantage",
    (
        "tests/unit/ops/test_zscore_properties.py",
        "assert torch.count_nonzero(out.edges[r.node_group[r.edge_child] == 2]) == 0, case.name",
    ): "zero-advantage",
    (
        "tests/unit/ops/test_zscore_properties.py",
        "assert out.dtype == torch.float32 and torch.count_nonzero(out[:size]) == 0",
    ): "zero-advantage",
    # the gathered multi-rank view runs the same arithmetic on the same table
    ("tests/unit/test_distributed.py", "assert torch.equal(torch.cat(got_edges), ref.edges)"): "distributed",
    ("tests/unit/test_distributed.py", "assert torch.equal(torch.cat(got_samples), ref.samples)"): "distributed",
    # N steps = k steps + resume + (N - k) steps
    ("tests/unit/test_resume.py", 'assert torch.equal(x, y), "weights must be bitwise equal after resume"'): "resume",
    (
        "tests/unit/test_resume.py",
        "assert torch.equal(torch.as_tensor(sa[k][name]), torch.as_tensor(sb[k][name])), name",
    ): "resume",
    ("tests/unit/test_resume.py", "assert torch.equal(x, y)"): "resume",
    ("tests/plugins/ddpo/test_ddpo.py", "assert torch.equal(a, b)"): "resume",
    # DiffusionNFT and TreeNFT: LoRA weights and the old weight copy after 1 step + resume + 1 step vs 2 steps
    # (tests/plugins/old_copy_helpers.py: DiffusionNFT's and TreeNFT's runs share the check)
    ("tests/plugins/old_copy_helpers.py", "assert torch.equal(x, y)"): "resume",
    (
        "tests/plugins/treenft/test_treenft_update.py",
        "assert torch.equal(copies.shadows[OLD][0], old) and torch.equal(policy.a.detach(), live)",
    ): "no-arithmetic",
    # media: an image model's samples are one-frame clips scored as the images; first frames, stacked frames and
    # grid tiles are views and copies of the decoded pixels
    ("tests/unit/ops/test_media.py", "assert torch.equal(got, direct), (reward.name, reduction)"): "one-frame",
    ("tests/unit/ops/test_media.py", "assert torch.equal(inputs, media[:, 0])"): "no-arithmetic",
    (
        "tests/unit/ops/test_media.py",
        "assert torch.equal(stack_frames(media)[:, :8], media[:, 0])  # the stacked PNG layout starts with frame 0",
    ): "no-arithmetic",
    (
        "tests/unit/models/test_wan_algorithms.py",
        "assert np.array_equal(tiles[2 * i], frame_strip(torch.from_numpy(before[i])).numpy())",
    ): "no-arithmetic",
    (
        "tests/unit/models/test_wan_algorithms.py",
        "assert np.array_equal(tiles[2 * i + 1], frame_strip(torch.from_numpy(after[i])).numpy())",
    ): "no-arithmetic",
    # `rlpost recipes copy` copies a shipped recipe's bytes
    ("tests/unit/test_recipes_cmd.py", 'assert (tmp_path / "mine.yaml").read_bytes() == source'): "no-arithmetic",
    ("tests/unit/test_recipes_cmd.py", 'assert (tmp_path / "treegrpo_r07.yaml").read_bytes() == r07'): "no-arithmetic",
}

# One bitwise comparison each. A call is found by its name; "not <call>" / "not all(<call>" are skipped per call.
_CALLS = re.compile(r"\b(?:torch\.equal|np\.array_equal|numpy\.array_equal|assert_array_equal|torch\.count_nonzero)\(")
_OTHER = [
    re.compile(r"\batol\s*=\s*0(?:\.0*)?(?![\w.])"),  # assert_close / allclose with atol=0 (rtol=0 alone is fine)
    re.compile(r"(?:\.tobytes\(\)|\.read_bytes\(\)|\.digest\(\)|\.hexdigest\(\))\s*=="),  # bytes / hash equality
    re.compile(r"\bhashlib\.\w+\("),
    re.compile(r"\.abs\(\)\.max\(\)\s*==\s*0\b"),  # exact-zero checks
    # .tolist() == <float list>; integer / bool literals and list(range(...)) are exact
    re.compile(r"\.tolist\(\)\s*==\s*(?!\s)(?!pytest\.approx|list\(range|\[\s*(?:True|False|-?\d+)\s*[,\]])"),
]
_NEGATED = re.compile(r"\bnot\s+(?:all\(|any\()?$")


def _flagged(line: str) -> bool:
    calls = [m for m in _CALLS.finditer(line) if not _NEGATED.search(line[: m.start()])]
    return bool(calls) or any(p.search(line) for p in _OTHER)


def _bitwise_lines() -> list[tuple[str, int, str]]:
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "tests/meta/test_bitwise_policy.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if _flagged(line):
                found.append((rel, number, line.strip()))
    return found


def test_every_bitwise_assertion_relies_on_a_documented_guarantee() -> None:
    unlisted = [f"{path}:{number}: {line}" for path, number, line in _bitwise_lines() if (path, line) not in ALLOWED]
    assert not unlisted, (
        "bitwise comparisons without a documented guarantee (use tests/tolerances.py, or add the line to ALLOWED in "
        "tests/meta/test_bitwise_policy.py with one of GUARANTEES):\n" + "\n".join(unlisted)
    )


def test_allowlist_has_no_stale_entries() -> None:
    present = {(path, line) for path, _, line in _bitwise_lines()}
    stale = [f"{path}: {line}" for path, line in ALLOWED if (path, line) not in present]
    assert not stale, "ALLOWED lists lines that are no longer in tests/ (remove them):\n" + "\n".join(stale)


def test_each_guarantee_is_still_promised_by_its_doc() -> None:
    assert set(ALLOWED.values()) <= set(GUARANTEES)
    for name, (doc, phrase) in GUARANTEES.items():
        text = " ".join((ROOT / doc).read_text().split())
        assert " ".join(phrase.split()) in text, f"guarantee {name!r}: {doc} no longer says {phrase!r}"


def test_scanner_sees_what_it_must() -> None:
    """The patterns catch the usual spellings and skip negations and exact integer lists."""
    hits = [
        "assert torch.equal(a, b)",
        "torch.testing.assert_close(a, b, rtol=0, atol=0)",
        "assert np.array_equal(x, y)",
        "assert a.tobytes() == b.tobytes()",
        "assert out.abs().max() == 0",
        "assert adv.tolist() == [0.1, 0.2]",
        "assert not torch.equal(a, b) and torch.equal(c, d)",
    ]
    misses = [
        "assert not torch.equal(a, b)",
        "assert not all(torch.equal(a[k], c[k]) for k in a)",
        "torch.testing.assert_close(a, b, rtol=0, atol=1e-6)",
        "assert fallback.tolist() == [True, False]",
        "assert idx.tolist() == list(range(10))",
        "assert adv.tolist() == pytest.approx([0.1, 0.2])",
    ]
    assert [line for line in hits if not _flagged(line)] == []
    assert [line for line in misses if _flagged(line)] == []
