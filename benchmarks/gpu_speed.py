"""Seconds per iteration, rollout/update split, ratio-guard error and peak GPU memory of one shipped preset, one
algorithm per process, on random-weight SD3.5-medium, FLUX.1-dev or Wan2.1-T2V-1.3B architectures.

    python benchmarks/gpu_speed.py build  --model-dir DIR                  # random SD3.5-medium architecture, once
    python benchmarks/gpu_speed.py build  --family flux --model-dir DIR2   # random FLUX.1-dev architecture, once
    python benchmarks/gpu_speed.py build  --family wan --model-dir DIR3    # random Wan2.1-T2V-1.3B architecture, once
    python benchmarks/gpu_speed.py run    --preset treegrpo-paper --model-dir DIR --out OUT/treegrpo-paper.json
    python benchmarks/gpu_speed.py run    --preset treegrpo-paper+fast --model-dir DIR --out OUT/tree-fast.json
    python benchmarks/gpu_speed.py run    --preset treegrpo-paper@32 --model-dir DIR --out OUT/tree-32.json
    python benchmarks/gpu_speed.py report OUT                              # OUT/device_check.{json,md}

``benchmarks/device_check.sh`` runs the steps for TreeGRPO (paper and official-code presets) and DanceGRPO on SD3.5,
each without and with the speed-ups, then TreeGRPO and DanceGRPO on Wan2.1-1.3B, so one GPU run measures them all.

**Arms.** ``--preset`` takes ``PRESET[+fast][@GROUPS]``: a preset of :data:`PRESETS`; ``+fast`` turns on the
speed-ups of :data:`FAST` (``run.speedups``, docs/speed.md; ``--accelerate KEY=VALUE`` replaces them) so the ratio
guard runs before the first step and its measured ``max |ratio - 1|`` is recorded; ``@GROUPS`` sets the prompts per
iteration (``@32``: the paper's 32, TreeGRPO's frontier chunked by the recipe's ``chunk_size``).

What is measured. Each ``run`` loads the preset's **shipped recipe** (``recipes/<preset>_sd35.yaml``: sampler, tree
shape, optimizer layout, full fine-tuning, gradient checkpointing, CFG 4.5, 512 px) and changes only what a GPU
check without downloads must change: the model is a random-weight pipeline of the SD3.5-medium architecture (speed
does not depend on weight values; :func:`gpu_sd35.build_random_sd35`), the reward is ``jpeg-compressibility`` (the
HPS-v2.1 checkpoint cannot be fetched; the reward is <1% of an iteration), prompts are a fixed list, the run is one
process without DeepSpeed, and ``groups_per_step`` is small (``--groups``; the presets use 32 over 8 GPUs). It then
runs ``--iterations`` training steps through :class:`rlpost.engine.runner.Runner` (CUDA-synchronised wall time per
step), drops the first step (CUDA/cuBLAS warm-up, and with ``torch.compile`` the shapes the guard did not see) from
the mean, and records ``torch.cuda.max_memory_allocated`` per phase (rollout; rewards, advantages and update) and
over the whole run, in a fresh process so that no other algorithm's weights or caches count towards it. Set-up time
includes loading, compilation for the guard's shapes and the guard itself.

FLUX presets (``*-flux``: ``recipes/<algorithm>_flux.yaml``) run on a random-weight pipeline of the FLUX.1-dev
architecture (12B transformer; :func:`gpu_flux.build_random_flux1`) at 512 px in bf16, with one more substitution:
the recipes fully fine-tune the transformer under ZeRO-3 across 16-32 GPUs, which one GPU cannot hold (12B
parameters with AdamW state), so the check trains a LoRA adapter of rank 64 on the same attention projections
instead. Forward and backward passes cost the same up to the adapter; the optimizer step is the part not measured.

Wan presets (``*-wan``) take the SD3.5 preset's algorithm settings (sampler, advantage, update layout, full
fine-tuning, gradient checkpointing) with the model swapped for a random-weight Wan2.1-T2V-1.3B
(:func:`gpu_wan.build_random_wan21`) at ``--video FRAMESxHEIGHTxWIDTH`` (default 33x480x832), CFG 5.0, 512 text
tokens, and fewer rows per forward and per minibatch (:data:`WAN_LAYOUT`: a 33-frame 480x832 video is 14,040
transformer tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from gpu_flux import build_random_flux1  # noqa: E402 - benchmarks/ is not a package
from gpu_sd35 import PROMPTS as ALL_PROMPTS  # noqa: E402
from gpu_sd35 import build_random_sd35  # noqa: E402
from gpu_wan import build_random_wan21  # noqa: E402

from rlpost.core.hookspecs import hookimpl  # noqa: E402

PROMPTS = ALL_PROMPTS[:8]

PRESETS: dict[str, dict[str, Any]] = {
    "treegrpo-paper": {"label": "TreeGRPO (paper preset)", "recipe": "recipes/treegrpo_sd35.yaml"},
    "treegrpo-code": {"label": "TreeGRPO (official-code preset)", "recipe": "recipes/treegrpo_code_sd35.yaml"},
    "dancegrpo": {"label": "DanceGRPO", "recipe": "recipes/dancegrpo_sd35.yaml"},
    "mixgrpo": {"label": "MixGRPO", "recipe": "recipes/mixgrpo_sd35.yaml"},
    "ddpo": {"label": "DDPO", "recipe": "recipes/ddpo_sd35.yaml"},
    "treegrpo-flux": {"label": "TreeGRPO on FLUX.1-dev", "recipe": "recipes/treegrpo_flux.yaml", "family": "flux"},
    "dancegrpo-flux": {"label": "DanceGRPO on FLUX.1-dev", "recipe": "recipes/dancegrpo_flux.yaml", "family": "flux"},
    "mixgrpo-flux": {"label": "MixGRPO on FLUX.1-dev", "recipe": "recipes/mixgrpo_flux.yaml", "family": "flux"},
    "ddpo-flux": {"label": "DDPO on FLUX.1-dev", "recipe": "recipes/ddpo_flux.yaml", "family": "flux"},
    "treegrpo-wan": {"label": "TreeGRPO (paper preset) on Wan2.1-1.3B", "recipe": "recipes/treegrpo_sd35.yaml",
                     "family": "wan"},
    "dancegrpo-wan": {"label": "DanceGRPO on Wan2.1-1.3B", "recipe": "recipes/dancegrpo_sd35.yaml", "family": "wan"},
    # The rest of the field at its SD3.5 preset (the field arms: FIELD_ARMS).
    "flowgrpo": {"label": "Flow-GRPO", "recipe": "recipes/flowgrpo_sd35.yaml"},
    "flowgrpo-fast": {"label": "Flow-GRPO-Fast", "recipe": "recipes/flowgrpo_fast_sd35.yaml"},
    "grpo-guard": {"label": "GRPO-Guard", "recipe": "recipes/grpo_guard_sd35.yaml"},
    "branchgrpo": {"label": "BranchGRPO (SD3.5 preset)", "recipe": "recipes/branchgrpo_sd35.yaml"},
    "tempflow": {"label": "TempFlow-GRPO", "recipe": "recipes/tempflow_sd35.yaml"},
    "nft": {"label": "DiffusionNFT", "recipe": "recipes/nft_sd35.yaml"},
    "awm": {"label": "AWM", "recipe": "recipes/awm_sd35.yaml"},
    "dgpo": {"label": "DGPO", "recipe": "recipes/dgpo_sd35.yaml"},
    "treenft": {"label": "TreeNFT", "recipe": "recipes/treenft_sd35.yaml"},
    "branchgrpo-flux": {"label": "BranchGRPO on FLUX.1-dev", "recipe": "recipes/branchgrpo_flux.yaml",
                        "family": "flux"},
}  # fmt: skip
FIELD_ARMS: tuple[str, ...] = (
    "flowgrpo", "flowgrpo-fast", "grpo-guard", "branchgrpo", "tempflow", "nft", "awm", "dgpo", "treenft",
)  # fmt: skip
"""The SD3.5 arms beyond the default device check, for ``device_check.sh OUT $FIELD`` (its header)."""
FLUX_CHECK_LORA: dict[str, Any] = {"rank": 64, "alpha": 64}
"""The adapter FLUX presets train on one GPU in place of the recipes' full fine-tuning (see the module docstring)."""
FAST: dict[str, Any] = {"compile": "both", "compile_regional": True, "vae_channels_last": True}
"""The ``+fast`` arms' ``run.speedups``: regional ``torch.compile`` of the transformer for rollout and update and a
channels-last VAE. Not CUDA graphs (a tree's frontier takes a new shape every depth) and no attention backend (torch
already picks its flash or cuDNN kernel for bf16 on Hopper): pass ``--accelerate`` to measure those."""
WAN_LAYOUT: dict[str, int] = {"chunk_size": 4, "minibatch_edges": 3}
"""Rows per no-grad forward and VAE decode, and edges per training minibatch (one TreeGRPO parent) for Wan."""
WAN_VIDEO = "33x480x832"
PAPER_RECIPE = ROOT / "recipes" / "bench" / "digits.yaml"


def parse_arm(arm: str) -> tuple[str, bool, int | None]:
    """``PRESET[+fast][@GROUPS]`` as ``(preset, fast, groups)``.

    Raises:
        ValueError: An unknown preset or a malformed suffix.
    """
    rest, _, groups = arm.partition("@")
    preset, plus, fast = rest.partition("+")
    if preset not in PRESETS or (plus and fast != "fast") or (groups and not groups.isdigit()):
        raise ValueError(f"{arm!r}: expected PRESET[+fast][@GROUPS] with PRESET one of {sorted(PRESETS)}")
    return preset, bool(plus), int(groups) if groups else None


def paper_s_per_iter() -> dict[str, float]:
    """The TreeGRPO paper's Table 1 s/iter (arXiv 2512.08153, SD3.5-medium, 8xA100, 32 prompts per iteration), from
    the bench recipe's ``paper`` section; a value with a note there comes from another table and is left out."""
    from rlpost.bench import load_bench

    section = load_bench(str(PAPER_RECIPE)).paper["s_per_iter"]
    return {k: v for k, v in section["values"].items() if k not in section["notes"]}


def cmd_build(ns: argparse.Namespace) -> int:
    """Build (once) the random-weight SD3.5-medium-, FLUX.1-dev- or Wan2.1-1.3B-architecture pipeline."""
    t0 = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if ns.family == "flux":
        path = build_random_flux1(Path(ns.model_dir), ns.layers, ns.layers, device)
    elif ns.family == "wan":
        path = build_random_wan21(Path(ns.model_dir), ns.layers, device)
    else:
        path = build_random_sd35(Path(ns.model_dir), ns.layers, device)
    print(f"model at {path} ({time.perf_counter() - t0:.1f} s)")
    return 0


def _video(spec: str) -> dict[str, int]:
    frames, height, width = (int(v) for v in spec.lower().split("x"))
    return {"num_frames": frames, "height": height, "width": width}


def preset_config(
    arm: str,
    model_dir: str,
    groups: int,
    iterations: int,
    out_dir: str,
    device: str = "cuda",
    resolution: int = 512,
    accelerate: dict[str, Any] | None = None,
    video: str = WAN_VIDEO,
    chunk_size: int | None = None,
    minibatch_edges: int | None = None,
) -> dict[str, Any]:
    """The shipped recipe of ``arm``'s preset with the GPU-check substitutions listed in the module docstring;
    ``accelerate`` replaces the ``+fast`` arms' :data:`FAST`, the arm's ``@GROUPS`` replaces ``groups``."""
    from rlpost.engine.recipe import merge_sources

    preset, fast, arm_groups = parse_arm(arm)
    family = PRESETS[preset].get("family", "sd3")
    cfg = merge_sources([str(ROOT / PRESETS[preset]["recipe"])])
    cfg["run"].update(
        {
            "output_dir": out_dir,
            "max_steps": iterations,
            "groups_per_step": arm_groups or groups,
            "device": device,
            "progress": False,
        }
    )
    if fast:
        cfg["run"]["speedups"] = dict(FAST if accelerate is None else accelerate)
    model = cfg["model"]["init_args"]
    model["pretrained"] = model_dir
    if family == "wan":
        keep = ("dtype", "full_finetune", "gradient_checkpointing", "reference", "lora", "time_grid", "shift")
        init = {k: v for k, v in model.items() if k in keep}
        init |= {"pretrained": model_dir, "guidance_scale": 5.0, "max_sequence_length": 512, **_video(video)}
        cfg["model"] = {"class_path": "wan", "init_args": init}
        cfg["sampler"].setdefault("init_args", {})["chunk_size"] = WAN_LAYOUT["chunk_size"]
        cfg["optimizer"].setdefault("init_args", {})["minibatch_edges"] = WAN_LAYOUT["minibatch_edges"]
    else:
        model["resolution"] = resolution
    if family == "flux":
        model.update({"full_finetune": False, "reference": False, "lora": dict(FLUX_CHECK_LORA)})
    if chunk_size is not None:
        cfg["sampler"].setdefault("init_args", {})["chunk_size"] = chunk_size
    if minibatch_edges is not None:
        cfg["optimizer"].setdefault("init_args", {})["minibatch_edges"] = minibatch_edges
    cfg["prompts"] = {"class_path": "prompt-list", "init_args": {"prompts": PROMPTS}}
    cfg["rewards"] = [{"class_path": "jpeg-compressibility"}]
    cfg.pop("reward_weights", None)
    for key in ("distributed", "eval", "ema"):
        cfg.pop(key, None)
    cfg["checkpoint"] = {"every": 0, "keep_last": 1, "at_end": False}
    return cfg


class PhaseMemory:
    """Lifecycle probe: peak CUDA memory of each rollout (read and reset at ``rlpost_after_rollout``); the caller reads
    the rest of the step's peak (rewards, advantages, update) after the step."""

    def __init__(self) -> None:
        self.rollout_gib: list[float] = []

    @hookimpl
    def rlpost_after_rollout(self, run: Any, rollout: Any) -> None:
        """Record the rollout's peak and start the update's."""
        if torch.cuda.is_available():
            self.rollout_gib.append(torch.cuda.max_memory_allocated() / 2**30)
            torch.cuda.reset_peak_memory_stats()


def _accelerate_pairs(pairs: list[str] | None) -> dict[str, Any] | None:
    if not pairs:
        return None
    out = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        out[key.strip()] = yaml.safe_load(value)
    return out


def cmd_run(ns: argparse.Namespace) -> int:
    """Time ``--iterations`` steps of one arm and write a JSON record."""
    from rlpost.apps.host import get_host
    from rlpost.engine.recipe import validate
    from rlpost.engine.runner import Runner

    preset, fast, _ = parse_arm(ns.preset)
    cuda = torch.cuda.is_available()
    if not cuda and not ns.allow_cpu:
        print("gpu_speed.py run: no CUDA device (--allow-cpu runs a plumbing smoke test)", file=sys.stderr)
        return 1
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    accelerate = _accelerate_pairs(ns.accelerate)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = preset_config(
            ns.preset,
            ns.model_dir,
            ns.groups,
            ns.iterations,
            str(Path(tmp) / "run"),
            "cuda" if cuda else "cpu",
            ns.resolution,
            accelerate,
            ns.video,
            ns.chunk_size,
            ns.minibatch_edges,
        )
        host = get_host()
        memory = PhaseMemory()
        host.register_plugin(memory, name="gpu_speed.memory")
        recipe = validate(cfg, host)
        runner = Runner(recipe, host)
        t0 = time.perf_counter()
        runner.setup()
        sync()
        setup_s = time.perf_counter() - t0
        setup_mem = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        times, steps, update_gib = [], [], []
        for _ in range(ns.iterations):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            sync()
            t = time.perf_counter()
            metrics = runner.step()
            sync()
            times.append(time.perf_counter() - t)
            update_gib.append(torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"))
            keep = ("perf/", "train/", "reward/", "accelerate/")
            steps.append({k: v for k, v in metrics.items() if k.startswith(keep)})
            print(f"{ns.preset}: step {len(times)} {times[-1]:.2f} s", flush=True)
        timed = times[1:] or times
        counts = recipe.counts()
        check = runner.ratio_check
        peaks = [setup_mem, *memory.rollout_gib, *update_gib]
        record = {
            "preset": ns.preset,
            "base_preset": preset,
            "label": PRESETS[preset]["label"] + (" + speed-ups" if fast else ""),
            "recipe": PRESETS[preset]["recipe"],
            "family": PRESETS[preset].get("family", "sd3"),
            "model": cfg["model"],
            "groups_per_step": recipe.run.groups_per_step,
            "chunk_size": getattr(recipe.sampler, "chunk_size", None),
            "minibatch_edges": recipe.optimizer.minibatch_edges,
            "accelerate": dataclasses.asdict(recipe.run.speedups),
            "speedups": recipe.run.speedups.enabled(),
            "ratio_check": check.as_dict() if check is not None else None,
            "first_ratio_dev": statistics.fmean(s.get("train/first_ratio_dev", float("nan")) for s in steps),
            "iterations": ns.iterations,
            "setup_s": setup_s,
            "s_per_iter_all": times,
            "s_per_iter_mean": statistics.fmean(timed),
            "s_per_iter_min": min(timed),
            "s_per_iter_max": max(timed),
            "warm_up_only": len(times) < 2,
            "peak_mem_gib": max(peaks) if cuda else float("nan"),
            "mem_after_setup_gib": setup_mem,
            "peak_rollout_gib": max(memory.rollout_gib, default=float("nan")),
            "peak_update_gib": max(update_gib, default=float("nan")),
            "images_per_iter": counts.images,
            "trainable_edges_per_iter": counts.trainable_edges,
            "expected_rollout_rows": counts.rollout_forwards,
            "expected_train_rows": counts.train_forwards,
            "steps": steps,
            "device": torch.cuda.get_device_name(0) if cuda else "cpu (plumbing smoke test, not a measurement)",
            "torch": torch.__version__,
        }
        host.unregister_plugin("gpu_speed.memory")
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(record, indent=1))
    print(f"{ns.preset}: {record['s_per_iter_mean']:.2f} s/iter, peak {record['peak_mem_gib']:.1f} GiB")
    return 0


def _phase(rec: dict[str, Any], key: str) -> float:
    values = [s.get(key, float("nan")) for s in rec["steps"][1:] or rec["steps"]]
    return statistics.fmean(values) if values else float("nan")


def _is_arm(name: str) -> bool:
    try:
        parse_arm(name)
    except ValueError:
        return False
    return True


def report_lines(records: list[dict[str, Any]]) -> list[str]:
    """``device_check.md``: one row per arm, then the DanceGRPO/TreeGRPO ratios per speed-up setting and what the
    speed-ups bought per preset."""
    done = [r for r in records if "skipped" not in r]
    head = done[0] if done else records[0]
    lines = [
        "# GPU check: SD3.5-medium, FLUX.1-dev and Wan2.1-1.3B architectures (random weights), bf16, one GPU",
        "",
        f"Device: {head.get('device', '?')}, torch {head.get('torch', '?')}. Each arm ran in its own process; "
        "s/iter is the mean of the steps after the first (warm-up; '(1 step)' marks an arm timed by its warm-up step "
        "alone). Set-up includes loading, torch.compile for the guard's shapes and the ratio guard. Guard error: max "
        "abs(ratio - 1) of one rollout re-evaluated through the training path (speed-up arms); first-step ratio dev: "
        "the update's own train/first_ratio_dev (every arm). Peak memory: torch.cuda.max_memory_allocated, rollout "
        "and the rest of the step (rewards, advantages, update).",
        "",
        "| arm | method | speed-ups | prompts/iter | images/iter | s/iter (mean, min-max) | rollout s | update s "
        "| set-up s | guard error | first-step ratio dev | peak GiB (rollout / update) | paper s/iter (32 prompts, "
        "8xA100) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    published = paper_s_per_iter()
    for r in done:
        paper = published.get(r.get("base_preset", r["preset"]))
        check = r.get("ratio_check")
        guard = f"{check['max_error']:.2g}" if check else "-"
        one = " (1 step)" if r.get("warm_up_only") else ""
        lines.append(
            f"| `{r['preset']}` | {r['label']} | {', '.join(r.get('speedups') or []) or 'none'} "
            f"| {r['groups_per_step']} | {r['images_per_iter']} "
            f"| {r['s_per_iter_mean']:.2f} ({r['s_per_iter_min']:.2f}-{r['s_per_iter_max']:.2f}){one} "
            f"| {_phase(r, 'perf/rollout_sec'):.2f} | {_phase(r, 'perf/update_sec'):.2f} | {r['setup_s']:.0f} "
            f"| {guard} | {r.get('first_ratio_dev', float('nan')):.2g} "
            f"| {r.get('peak_rollout_gib', float('nan')):.1f} / {r.get('peak_update_gib', float('nan')):.1f} "
            f"| {paper if paper is not None else '-'} |"
        )
    for r in records:
        if "skipped" in r:
            lines.append(f"| `{r['preset']}` | {r['label']} | skipped: {r['skipped']} |" + " |" * 10)
    by = {r["preset"]: r for r in done}
    ref, fast = published["dancegrpo"], published["treegrpo-paper"]
    lines.append("")
    for suffix in ("", "+fast"):
        for tree in ("treegrpo-paper", "treegrpo-code"):
            dance, other = by.get(f"dancegrpo{suffix}"), by.get(f"{tree}{suffix}")
            if dance and other and dance["groups_per_step"] == other["groups_per_step"]:
                ratio = dance["s_per_iter_mean"] / other["s_per_iter_mean"]
                lines.append(
                    f"- DanceGRPO / {other['label']} s/iter: **{ratio:.2f}x** (paper: {ref} / {fast} = "
                    f"{ref / fast:.2f}x)"
                )
    for name, r in by.items():
        preset, is_fast, groups = parse_arm(name)
        plain = by.get(preset + (f"@{groups}" if groups else ""))
        if is_fast and plain is not None:
            gain = plain["s_per_iter_mean"] / r["s_per_iter_mean"]
            lines.append(f"- speed-ups on `{preset}`: {gain:.2f}x s/iter ({', '.join(r['speedups'])})")
    return lines


def cmd_report(ns: argparse.Namespace) -> int:
    """Collect every ``<arm>.json`` under OUT into ``device_check.json`` and ``device_check.md``."""
    out = Path(ns.out)
    records = [json.loads(p.read_text()) for p in sorted(out.glob("*.json")) if _is_arm(p.stem)]
    if not records:
        print(f"no preset results under {out}", file=sys.stderr)
        return 1
    lines = report_lines(records)
    (out / "device_check.md").write_text("\n".join(lines) + "\n")
    (out / "device_check.json").write_text(json.dumps({"records": records}, indent=1))
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse the sub-command and run it."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the random SD3.5-medium, FLUX.1-dev or Wan2.1-1.3B pipeline")
    b.add_argument("--model-dir", required=True)
    b.add_argument("--family", choices=("sd3", "flux", "wan"), default="sd3", help="architecture to build")
    b.add_argument("--layers", type=int, default=None, help="transformer depth override (CPU smoke test only)")
    r = sub.add_parser("run", help="time one arm")
    r.add_argument("--preset", required=True, help="PRESET[+fast][@GROUPS], PRESET one of " + ", ".join(PRESETS))
    r.add_argument("--model-dir", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--groups", type=int, default=1, help="prompt groups per iteration (an arm's @GROUPS wins)")
    r.add_argument("--iterations", type=int, default=3, help="training steps (the first is warm-up)")
    r.add_argument("--resolution", type=int, default=512)
    r.add_argument("--video", default=WAN_VIDEO, help="Wan presets: FRAMESxHEIGHTxWIDTH")
    r.add_argument("--chunk-size", type=int, default=None, help="sampler rows per forward/decode (memory)")
    r.add_argument("--minibatch-edges", type=int, default=None, help="update edges per minibatch (memory)")
    r.add_argument("--accelerate", action="append", help="KEY=VALUE of run.speedups for +fast arms (repeatable)")
    r.add_argument("--allow-cpu", action="store_true", help="run without CUDA (plumbing smoke test only)")
    p = sub.add_parser("report", help="aggregate the per-arm JSON files")
    p.add_argument("out")
    ns = parser.parse_args(argv)
    if ns.cmd == "run":
        try:
            parse_arm(ns.preset)
        except ValueError as exc:
            parser.error(str(exc))
    return {"build": cmd_build, "run": cmd_run, "report": cmd_report}[ns.cmd](ns)


if __name__ == "__main__":
    sys.exit(main())
