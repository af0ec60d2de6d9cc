"""Every ``--a.b value`` override form the documentation shows, through the parser of ``rlpost train``/``validate``.

The forms are collected from README.md, docs/*.md, the recipe headers and the ``rlpost`` command-line docstring
(lines of other commands, ``rlpost sample``/``export``/``bench`` and ``python -m ...``, are left out); each must be
exercised by a case below, which parses it with the recipe parser (``rlpost.engine.recipe.build_parser``, as the CLI
does) or the bench's path to it (``parse_recipe``) and checks that the value landed where the form says.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rlpost.apps import cli
from rlpost.apps.host import get_host, reset_host
from rlpost.engine.recipe import SECTION, RecipeError, build_parser, load_recipe, parse_recipe, parse_recipe_args

ROOT = Path(__file__).resolve().parents[2]
OTHER_COMMANDS = re.compile(r"rlpost (sample|export|bench|plugins)|python -m |-m rlpost")
OPTION = re.compile(r"(?<![\w-])--([a-z_]+(?:\.[A-Za-z_0-9]+)*)")


@pytest.fixture(autouse=True)
def _host():
    reset_host(None)
    yield
    reset_host(None)


def _documented_lines() -> list[tuple[str, str]]:
    """(file, line) of the documentation that may show an override: markdown, recipe comments, the CLI docstring."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    recipes = sorted((ROOT / "recipes").rglob("*.yaml"))
    out = [(p.name, line) for p in files for line in p.read_text(encoding="utf-8").splitlines()]
    for p in recipes:
        out += [(p.name, ln) for ln in p.read_text(encoding="utf-8").splitlines() if ln.lstrip().startswith("#")]
    out += [("rlpost/apps/cli.py", line) for line in (cli.__doc__ or "").splitlines()]
    return out


def documented_options() -> dict[str, set[str]]:
    """Option name (``sampler.init_args.k``) -> the files that show it, for ``rlpost train``/``validate``."""
    found: dict[str, set[str]] = {}
    other = previous_continues = False  # inside a continued command line (``\\``) of another command
    for where, line in _documented_lines():
        other = bool(OTHER_COMMANDS.search(line)) or (other and previous_continues)
        previous_continues = line.rstrip().endswith("\\")
        if other:
            continue
        for match in OPTION.finditer(line):
            name = match.group(1)
            if name == "recipe" or name.split(".")[0] in SECTION:
                found.setdefault(name, set()).add(where)
    return found


@dataclass
class Case:
    """One documented form: the command line after ``rlpost train`` and the values it must set."""

    id: str
    argv: list[str]
    expect: dict[str, Any] = field(default_factory=dict)

    def options(self) -> set[str]:
        return {t[2:].split("=")[0] for t in self.argv if t.startswith("--")}


TINY = "recipes/tiny/treegrpo.yaml"
DIGITS = "recipes/treegrpo_digits.yaml"
SD35 = "recipes/treegrpo_sd35.yaml"
BENCH = ["--recipe", "recipes/bench/digits/base.yaml", "--recipe", "recipes/bench/digits/treegrpo_paper.yaml"]
HELDOUT = {"heldout": {"class_path": "rlpost_digits.prompts.DigitsPrompts", "init_args": {"split": "eval"}}}
CASES = [
    Case("init_args", ["--recipe", TINY, "--sampler.init_args.k", "3"], {"sampler.init_args.k": 3}),
    Case("shorthand", ["--recipe", TINY, "--sampler.k=4"], {"sampler.init_args.k": 4}),
    Case(
        "speedups",
        ["--recipe", TINY, "--run.speedups.compile", "both", "--run.speedups.ratio_tolerance", "1e-4"],
        {"run.speedups.compile": "both", "run.speedups.ratio_tolerance": 1e-4, "run.seed": 0},
    ),
    Case(
        "deprecated-accelerate",  # the old name of run.speedups still works (FutureWarning)
        ["--recipe", TINY, "--run.accelerate.compile", "both"],
        {"run.accelerate.compile": "both", "run.seed": 0},  # validation moves it to run.speedups
    ),
    Case(
        "seed-and-dir",
        ["--recipe", DIGITS, "--run.seed", "3", "--run.output_dir", "/tmp/mj3"],
        {"run.seed": 3, "run.output_dir": "/tmp/mj3"},
    ),
    Case(
        "prompt-split",
        ["--recipe", DIGITS, "--prompts.init_args.split", "pretrain"],
        {"prompts.init_args.split": "pretrain"},
    ),
    Case(
        "long-run",
        [
            *BENCH,
            "--run.max_steps",
            "250",
            "--eval.every",
            "10",
            "--eval.sets",
            "{heldout: {class_path: digit-prompts, init_args: {split: eval}}}",
            "--eval.save_images",
            "false",
        ],
        {"run.max_steps": 250, "eval.every": 10, "eval.sets": HELDOUT, "eval.save_images": False},
    ),
    Case(
        "scheduler",
        [*BENCH, "--lr_scheduler", "{class_path: torch.optim.lr_scheduler.CosineAnnealingLR, init_args: {T_max: 500}}"],
        {"lr_scheduler.class_path": "torch.optim.lr_scheduler.CosineAnnealingLR", "lr_scheduler.init_args.T_max": 500},
    ),
    Case(
        "run-length-schedule",
        [
            *("--recipe", DIGITS, "--recipe", "recipes/ablations/lr_decay_to_end.yaml"),
            *("--lr_scheduler.init_args.shape", "cosine", "--lr_scheduler.init_args.warmup", "0.05"),
        ],
        {"lr_scheduler.init_args.shape": "cosine", "lr_scheduler.init_args.warmup": 0.05},
    ),
    Case(
        "qualified-reward",
        ["--recipe", TINY, "--rewards", "[rlpost:jpeg-compressibility]"],
        {"rewards[0].class_path": "rlpost_rewards.jpeg.JpegCompressibility"},
    ),
    Case("prompt-file", ["--recipe", SD35, "--prompts.path", "prompts.txt"], {"prompts.init_args.path": "prompts.txt"}),
    Case(
        "eval-set-file",
        ["--recipe", SD35, "--eval.sets.hpdv2.path", "prompts.txt"],
        {"eval.sets.hpdv2.init_args.path": "prompts.txt", "eval.sets.hpdv2.init_args.column": "prompt"},
    ),
    Case(
        "mixgrpo-flash",
        [
            *("--recipe", "recipes/mixgrpo_sd35.yaml", "--sampler.compress_ratio", "0.4"),
            *("--sampler.dpm_after_window", "true", "--sampler.shift_interval", "20"),
        ],
        {
            "sampler.init_args.compress_ratio": 0.4,
            "sampler.init_args.dpm_after_window": True,
            "sampler.init_args.shift_interval": 20,
        },
    ),
    Case(
        "fixed-window",
        ["--recipe", SD35, "--recipe", "recipes/ablations/treegrpo_fixed_window.yaml", "--sampler.fixed_start", "2"],
        {"sampler.init_args.window": "fixed", "sampler.init_args.fixed_start": 2},
    ),
    Case(
        "tree-shape",
        [
            *("--recipe", SD35, "--recipe", "recipes/ablations/treegrpo_progressive_window.yaml"),
            *("--sampler.k", "2", "--sampler.depth", "4"),
        ],
        {"sampler.init_args.k": 2, "sampler.init_args.depth": 4, "sampler.init_args.window": "progressive"},
    ),
    Case(
        "overlay",
        [
            *("--recipe", TINY, "--recipe", "recipes/ablations/treegrpo_leaf_zscore.yaml"),
            *("--run.output_dir", "runs/ablation"),
        ],
        {
            "advantage.class_path": "rlpost_treegrpo.advantage.LeafZScoreAdvantage",
            "advantage.init_args.aggregate": "sum",
            "run.output_dir": "runs/ablation",
            "run.max_steps": 2,  # the base recipe's
        },
    ),
    Case(
        "wan-upstream-frames",
        [
            *("--recipe", "recipes/dancegrpo_wan21_1.3b.yaml", "--model.pretrained", "/path/to/dir"),
            *("--model.num_frames", "1", "--model.height", "512", "--model.width", "512"),
            *("--reward_frames.reduction", "mean"),
        ],
        {
            "model.init_args.pretrained": "/path/to/dir",
            "model.init_args.num_frames": 1,
            "model.init_args.height": 512,
            "model.init_args.width": 512,
            "reward_frames.reduction": "mean",
        },
    ),
    Case(
        "qwenimage-weights",
        [
            *("--recipe", "recipes/treegrpo_qwenimage.yaml", "--model.pretrained", "/path/to/Qwen-Image"),
            *("--model.resolution", "30"),  # parsed here; refused by validation (docs/models.md)
        ],
        {"model.init_args.pretrained": "/path/to/Qwen-Image", "model.init_args.resolution": 30},
    ),
    Case(
        "whole-components",
        [
            *("--recipe", TINY, "--optimizer", "clipped-surrogate", "--advantage", "tree-backup"),
            *("--prompts", "{class_path: prompt-list, init_args: {prompts: [a cat]}}"),
            *("--model.init_args.resolution", "64"),
            *("--model", "{class_path: sd3, init_args: {pretrained: tiny-random, resolution: 32}}"),
        ],
        {
            "optimizer.class_path": "rlpost.components.clipped_surrogate.ClippedSurrogate",
            "optimizer.init_args.clip_range": 1.0e-4,  # same class: the recipe's arguments stay (jsonargparse)
            "advantage.class_path": "rlpost_treegrpo.advantage.TreeBackupAdvantage",
            "prompts.init_args.prompts": ["a cat"],
            "model.init_args.resolution": 32,  # the later option wins
        },
    ),
]


def _fits(documented: str, option: str) -> bool:
    """Whether ``option`` is an instance of the ``documented`` form (an upper-case segment is a placeholder:
    ``eval.sets.NAME.path``)."""
    a, b = documented.split("."), option.split(".")
    return len(a) == len(b) and all(x == y or x.isupper() for x, y in zip(a, b, strict=True))


def _value(cfg: Any, path: str) -> Any:
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        cfg = cfg[int(part[1:-1])] if part.startswith("[") else cfg[part]
    return cfg


def test_every_documented_override_form_has_a_case() -> None:
    documented = documented_options()
    assert {"sampler.init_args.k", "sampler.k", "run.seed", "eval.sets", "rewards", "recipe"} <= set(documented)
    # --KEY.help NAME: tests/unit/test_cli_ux.py::test_component_help_works_for_every_registered_name covers every key
    helps = {f"{key}.help" for key in ("sampler", "model", "prompts", "rewards", "advantage", "optimizer")}
    covered = {name for case in CASES for name in case.options()} | helps
    missing = {name: sorted(files) for name, files in documented.items() if not any(_fits(name, c) for c in covered)}
    assert not missing, f"documented override forms without a case here: {missing}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_documented_override_lands(case: Case) -> None:
    cfg, _ = parse_recipe_args(build_parser(), case.argv, get_host())
    for path, expected in case.expect.items():
        assert _value(cfg, path) == expected, path


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_the_bench_path_parses_overrides_as_the_command_line(case: Case) -> None:
    """``parse_recipe`` (the bench, ``load_recipe``) gives the command line's result for the same files and options."""
    recipes = [case.argv[i + 1] for i, t in enumerate(case.argv) if t == "--recipe"]
    pairs = _pairs([t for i, t in enumerate(case.argv) if t != "--recipe" and case.argv[i - 1 : i] != ["--recipe"]])
    cfg, _ = parse_recipe_args(build_parser(), case.argv, get_host())
    assert parse_recipe(recipes, pairs, get_host()) == cfg


def _pairs(tokens: Sequence[str]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    it = iter(tokens)
    for token in it:
        key, eq, value = token[2:].partition("=")
        out.append((key, value if eq else next(it)))
    return out


def test_the_headline_override_validates_and_prints(capsys: pytest.CaptureFixture[str]) -> None:
    """``rlpost train --recipe recipes/tiny/treegrpo.yaml --sampler.init_args.k 3 --print_config``: validated and
    printed as the run would save it."""
    import yaml

    argv = ["train", "--recipe", TINY, "--sampler.init_args.k", "3", "--run.max_steps", "1", "--print_config"]
    assert cli.main(argv) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["sampler"]["init_args"]["k"] == 3 and printed["run"]["max_steps"] == 1
    recipe = load_recipe([TINY], [("sampler.init_args.k", "3"), ("run.max_steps", "1")], get_host())
    assert recipe.config == printed


def test_component_help_is_the_parsers(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["train", "--sampler.help", "tree"]) == 0
    assert "--sampler.k K" in capsys.readouterr().out
    with pytest.raises(RecipeError, match="sampler.help: asks for a help text"):
        parse_recipe([TINY], [("sampler.help", "tree")], get_host())


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("sampler.init_args.kk", "sampler.init_args.kk: unknown option; did you mean sampler.init_args.k?"),
        ("sampler.kk", "sampler.init_args.kk: unknown option; did you mean sampler.init_args.k?"),
        ("run.max_stpes", "run.max_stpes: unknown option; did you mean run.max_steps or run.max_skips?"),
        ("run.sed", "run.sed: unknown option; did you mean run.seed or run.speedups?"),
        ("samplr.k", "--samplr.k: unknown option; did you mean 'sampler'?"),
    ],
)
def test_an_unknown_key_gets_the_nearest_name(option: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["validate", "--recipe", TINY, f"--{option}", "2"]) == 2
    assert message in capsys.readouterr().err
    with pytest.raises(RecipeError) as err:
        parse_recipe([TINY], [(option, "2")], get_host())
    assert message in err.value.problems
