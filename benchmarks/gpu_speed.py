"""Seconds per iteration and peak GPU memory of one shipped SD3.5 or FLUX.1 preset, one algorithm per process.

    python benchmarks/gpu_speed.py build  --model-dir DIR                  # random SD3.5-medium architecture, once
    python benchmarks/gpu_speed.py build  --family flux --model-dir DIR2   # random FLUX.1-dev architecture, once
    python benchmarks/gpu_speed.py run    --preset treegrpo-paper --model-dir DIR --out OUT/treegrpo-paper.json
    python benchmarks/gpu_speed.py run    --preset dancegrpo-flux --model-dir DIR2 --out OUT/dancegrpo-flux.json
    python benchmarks/gpu_speed.py report OUT                              # OUT/device_check.{json,md}

``benchmarks/device_check.sh`` runs all three steps for TreeGRPO (paper and official-code presets) and DanceGRPO on
SD3.5, and DanceGRPO on FLUX.1-dev, so one GPU run measures both families.

What is measured. Each ``run`` loads the preset's **shipped recipe** (``recipes/<preset>_sd35.yaml``: sampler, tree
shape, optimizer layout, full fine-tuning, gradient checkpointing, CFG 4.5, 512 px) and changes only what a GPU
check without downloads must change: the model is a random-weight pipeline of the SD3.5-medium architecture (speed
does not depend on weight values; :func:`gpu_sd35.build_random_sd35`), the reward is ``jpeg-compressibility`` (the
HPS-v2.1 checkpoint cannot be fetched; the reward is <1% of an iteration), prompts are a fixed list, the run is one
process without DeepSpeed, and ``groups_per_step`` is small (``--groups``; the presets use 32 over 8 GPUs). It then
runs ``--iterations`` training steps through :class:`rlpost.engine.runner.Runner` (CUDA-synchronised wall time per
step), drops the first step (CUDA/cuBLAS warm-up) from the mean, and records ``torch.cuda.max_memory_allocated`` over
the whole run, in a fresh process so that no other algorithm's weights or caches count towards it.

FLUX presets (``*-flux``: ``recipes/<algorithm>_flux.yaml``) run on a random-weight pipeline of the FLUX.1-dev
architecture (12B transformer; :func:`gpu_flux.build_random_flux1`) at 512 px in bf16, with one more substitution:
the recipes fully fine-tune the transformer under ZeRO-3 across 16-32 GPUs, which one GPU cannot hold (12B
parameters with AdamW state), so the check trains a LoRA adapter of rank 64 on the same attention projections
instead. Forward and backward passes cost the same up to the adapter; the optimizer step is the part not measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from gpu_flux import build_random_flux1  # noqa: E402
from gpu_sd35 import PROMPTS as ALL_PROMPTS  # noqa: E402 - benchmarks/ is not a package
from gpu_sd35 import build_random_sd35  # noqa: E402

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
}
FLUX_CHECK_LORA: dict[str, Any] = {"rank": 64, "alpha": 64}
"""The adapter FLUX presets train on one GPU in place of the recipes' full fine-tuning (see the module docstring)."""
PAPER_RECIPE = ROOT / "recipes" / "bench" / "digits.yaml"


def paper_s_per_iter() -> dict[str, float]:
    """The TreeGRPO paper's Table 1 s/iter (arXiv 2512.08153, SD3.5-medium, 8xA100, 32 prompts per iteration), from
    the bench recipe's ``paper`` section; a value with a note there comes from another table and is left out."""
    from rlpost.bench import load_bench

    section = load_bench(str(PAPER_RECIPE)).paper["s_per_iter"]
    return {k: v for k, v in section["values"].items() if k not in section["notes"]}


def cmd_build(ns: argparse.Namespace) -> int:
    """Build (once) the random-weight SD3.5-medium- or FLUX.1-dev-architecture pipeline."""
    t0 = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if ns.family == "flux":
        path = build_random_flux1(Path(ns.model_dir), ns.layers, ns.layers, device)
    else:
        path = build_random_sd35(Path(ns.model_dir), ns.layers, device)
    print(f"model at {path} ({time.perf_counter() - t0:.1f} s)")
    return 0


def preset_config(
    preset: str, model_dir: str, groups: int, iterations: int, out_dir: str, device: str = "cuda", resolution: int = 512
) -> dict[str, Any]:
    """The shipped recipe of ``preset`` with the GPU-check substitutions listed in the module docstring."""
    from rlpost.engine.recipe import merge_sources

    cfg = merge_sources([str(ROOT / PRESETS[preset]["recipe"])])
    cfg["run"].update(
        {"output_dir": out_dir, "max_steps": iterations, "groups_per_step": groups, "device": device, "progress": False}
    )
    cfg["model"]["init_args"]["pretrained"] = model_dir
    cfg["model"]["init_args"]["resolution"] = resolution
    if PRESETS[preset].get("family") == "flux":
        cfg["model"]["init_args"].update({"full_finetune": False, "reference": False, "lora": dict(FLUX_CHECK_LORA)})
    cfg["prompts"] = {"class_path": "prompt-list", "init_args": {"prompts": PROMPTS}}
    cfg["rewards"] = [{"class_path": "jpeg-compressibility"}]
    cfg.pop("reward_weights", None)
    for key in ("distributed", "eval", "ema"):
        cfg.pop(key, None)
    cfg["checkpoint"] = {"every": 0, "keep_last": 1, "at_end": False}
    return cfg


def cmd_run(ns: argparse.Namespace) -> int:
    """Time ``--iterations`` steps of one preset and write a JSON record."""
    from rlpost.apps.host import get_host
    from rlpost.engine.recipe import validate
    from rlpost.engine.runner import Runner

    cuda = torch.cuda.is_available()
    if not cuda and not ns.allow_cpu:
        print("gpu_speed.py run: no CUDA device (--allow-cpu runs a plumbing smoke test)", file=sys.stderr)
        return 1
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = preset_config(
            ns.preset, ns.model_dir, ns.groups, ns.iterations, str(Path(tmp) / "run"),
            "cuda" if cuda else "cpu", ns.resolution,
        )
        host = get_host()
        recipe = validate(cfg, host)
        runner = Runner(recipe, host)
        t0 = time.perf_counter()
        runner.setup()
        sync()
        setup_s = time.perf_counter() - t0
        setup_mem = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        times, steps = [], []
        for _ in range(ns.iterations):
            sync()
            t = time.perf_counter()
            metrics = runner.step()
            sync()
            times.append(time.perf_counter() - t)
            steps.append({k: v for k, v in metrics.items() if k.startswith(("perf/", "train/", "reward/"))})
            print(f"{ns.preset}: step {len(times)} {times[-1]:.2f} s", flush=True)
        timed = times[1:] or times
        counts = recipe.counts()
        record = {
            "preset": ns.preset,
            "label": PRESETS[ns.preset]["label"],
            "recipe": PRESETS[ns.preset]["recipe"],
            "groups_per_step": ns.groups,
            "iterations": ns.iterations,
            "setup_s": setup_s,
            "s_per_iter_all": times,
            "s_per_iter_mean": statistics.fmean(timed),
            "s_per_iter_min": min(timed),
            "s_per_iter_max": max(timed),
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
            "mem_after_setup_gib": setup_mem,
            "images_per_iter": counts.images,
            "trainable_edges_per_iter": counts.trainable_edges,
            "expected_rollout_rows": counts.rollout_forwards,
            "expected_train_rows": counts.train_forwards,
            "steps": steps,
            "device": torch.cuda.get_device_name(0) if cuda else "cpu (plumbing smoke test, not a measurement)",
            "torch": torch.__version__,
        }
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(record, indent=1))
    print(f"{ns.preset}: {record['s_per_iter_mean']:.2f} s/iter, peak {record['peak_mem_gib']:.1f} GiB")
    return 0


def _phase(rec: dict[str, Any], key: str) -> float:
    values = [s.get(key, float("nan")) for s in rec["steps"][1:] or rec["steps"]]
    return statistics.fmean(values) if values else float("nan")


def cmd_report(ns: argparse.Namespace) -> int:
    """Collect every ``<preset>.json`` under OUT into ``device_check.json`` and ``device_check.md``."""
    out = Path(ns.out)
    records = [json.loads(p.read_text()) for p in sorted(out.glob("*.json")) if p.stem in PRESETS]
    if not records:
        print(f"no preset results under {out}", file=sys.stderr)
        return 1
    by = {r["preset"]: r for r in records}
    lines = [
        "# GPU check: SD3.5-medium and FLUX.1-dev architectures (random weights), 512 px, bf16, one GPU",
        "",
        f"Device: {records[0]['device']}, torch {records[0]['torch']}. Each preset ran in its own process; "
        "s/iter is the mean of the steps after the first (warm-up). Prompts per iteration: "
        f"{records[0]['groups_per_step']} (the presets use 32 across 8 GPUs).",
        "",
        "| preset | recipe | images/iter | trainable edges | s/iter (mean, min-max) | rollout s | update s "
        "| peak GPU memory | paper s/iter (32 prompts, 8xA100) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    published = paper_s_per_iter()
    for r in records:
        paper = published.get(r["preset"])
        lines.append(
            f"| {r['label']} | `{r['recipe']}` | {r['images_per_iter']} | {r['trainable_edges_per_iter']} "
            f"| {r['s_per_iter_mean']:.2f} ({r['s_per_iter_min']:.2f}-{r['s_per_iter_max']:.2f}) "
            f"| {_phase(r, 'perf/rollout_sec'):.2f} | {_phase(r, 'perf/update_sec'):.2f} "
            f"| {r['peak_mem_gib']:.1f} GiB | {paper if paper is not None else '-'} |"
        )
    if "dancegrpo" in by:
        lines.append("")
        for name in ("treegrpo-paper", "treegrpo-code"):
            if name in by:
                ratio = by["dancegrpo"]["s_per_iter_mean"] / by[name]["s_per_iter_mean"]
                ref, fast = published["dancegrpo"], published["treegrpo-paper"]
                paper = f"paper: {ref} / {fast} = {ref / fast:.2f}x"
                lines.append(f"- DanceGRPO / {by[name]['label']} s/iter: **{ratio:.2f}x** ({paper})")
    (out / "device_check.md").write_text("\n".join(lines) + "\n")
    (out / "device_check.json").write_text(json.dumps({"records": records}, indent=1))
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse the sub-command and run it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the random SD3.5-medium or FLUX.1-dev pipeline")
    b.add_argument("--model-dir", required=True)
    b.add_argument("--family", choices=("sd3", "flux"), default="sd3", help="architecture to build")
    b.add_argument("--layers", type=int, default=None, help="transformer depth override (CPU smoke test only)")
    r = sub.add_parser("run", help="time one preset")
    r.add_argument("--preset", required=True, choices=sorted(PRESETS))
    r.add_argument("--model-dir", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--groups", type=int, default=1, help="prompt groups per iteration")
    r.add_argument("--iterations", type=int, default=3, help="training steps (the first is warm-up)")
    r.add_argument("--resolution", type=int, default=512)
    r.add_argument("--allow-cpu", action="store_true", help="run without CUDA (plumbing smoke test only)")
    p = sub.add_parser("report", help="aggregate the per-preset JSON files")
    p.add_argument("out")
    ns = parser.parse_args(argv)
    return {"build": cmd_build, "run": cmd_run, "report": cmd_report}[ns.cmd](ns)


if __name__ == "__main__":
    sys.exit(main())
