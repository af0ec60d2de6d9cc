"""``rlpost download --recipe R [--recipe overlay ...] [--dry-run] [--dir DIR]``: every Hugging Face Hub file a recipe
needs, fetched into the Hugging Face cache, after which the recipe validates and trains with ``HF_HUB_OFFLINE=1``
(``docs/recipes.md``, "Getting the weights").

What a recipe needs is what its components declare (:meth:`rlpost.Component.hub_files`: the model adapter its base
model, each reward and judge its checkpoints, each prompt source its dataset files); the files go where
``huggingface_hub`` puts them (``snapshot_download``, as ``hf download`` does): the standard cache
(``HF_HUB_CACHE``, by default ``$HF_HOME/hub`` = ``~/.cache/huggingface/hub``), or ``--dir DIR`` (then train with
``HF_HUB_CACHE=DIR``). ``--dry-run`` prints the equivalent ``hf download`` commands as a shell script instead.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from rlpost.core.api import GATED_HINT, HubFiles
from rlpost.core.registry import Registries
from rlpost.engine.recipe import RecipeError, build_parser, parse_recipe_args, recipe_components

__all__ = ["cmd_download", "recipe_hub_files"]


def recipe_hub_files(argv: Sequence[str], host: Registries) -> dict[HubFiles, list[str]]:
    """Every :class:`HubFiles` the recipe on the command line ``argv`` (``--recipe`` files and ``--a.b value``
    options) declares, each with the fields that need it, in recipe order.

    Raises:
        RecipeError: The recipe does not parse, or a component refuses its arguments.
    """
    cfg, _ = parse_recipe_args(build_parser("rlpost download"), argv, host)
    needed: dict[HubFiles, list[str]] = {}
    for field, component in recipe_components(cfg, host):
        for files in component.hub_files():
            needed.setdefault(files, []).append(field)
    return needed


def _script(needed: dict[HubFiles, list[str]], cache_dir: str | None) -> str:
    lines = []
    for files, fields in needed.items():
        purpose = f" ({files.purpose})" if files.purpose else ""
        lines.append(f"# {', '.join(fields)}{purpose}")
        if files.gated:
            lines.append(f"# gated: {files.access_hint()}")
        lines.append(files.command(cache_dir))
    return "\n".join(lines)


def cmd_download(argv: Sequence[str]) -> int:
    """Fetch every Hugging Face Hub file a recipe needs (base model, reward and judge checkpoints, prompt datasets)
    into the Hugging Face cache, so that the recipe then runs with HF_HUB_OFFLINE=1.

    Usage: rlpost download --recipe R.yaml [--recipe overlay.yaml ...] [--a.b value ...] [--dry-run] [--dir DIR]
    """
    from rlpost.apps.host import build_host

    args = list(argv)
    dry_run = "--dry-run" in args
    args = [a for a in args if a != "--dry-run"]
    cache_dir: str | None = None
    if "-h" in args or "--help" in args:
        print(cmd_download.__doc__)
        print("  --dry-run   print the `hf download` commands (a shell script) instead of downloading")
        print("  --dir DIR   the Hugging Face cache to fill (default: HF_HUB_CACHE); train with HF_HUB_CACHE=DIR")
        return 0
    for i, a in enumerate(args):
        if a == "--dir" and i + 1 < len(args):
            cache_dir = str(Path(args[i + 1]).expanduser().resolve())
            del args[i : i + 2]
            break
        if a.startswith("--dir="):
            cache_dir = str(Path(a.removeprefix("--dir=")).expanduser().resolve())
            del args[i]
            break
    try:
        needed = recipe_hub_files(args, build_host())
    except RecipeError as exc:
        print(f"rlpost download: invalid recipe:\n{exc}", file=sys.stderr)
        return 2
    recipes = " ".join(f"--recipe {shlex.quote(a)}" for a in _recipe_args(args))
    if not needed:
        print("rlpost download: nothing to download: every file the recipe names is local or ships with rlpost")
        return 0
    if dry_run:
        print(_script(needed, cache_dir))
        return 0
    return _fetch(needed, cache_dir, recipes)


def _recipe_args(args: Sequence[str]) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--recipe"]


def _fetch(needed: dict[HubFiles, list[str]], cache_dir: str | None, recipes: str) -> int:
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError

    if constants.HF_HUB_OFFLINE:
        print(
            "rlpost download: HF_HUB_OFFLINE is set, so nothing can be downloaded; run this one command without it "
            "(training and validation keep HF_HUB_OFFLINE=1), or print the commands with --dry-run",
            file=sys.stderr,
        )
        return 2
    failed = 0
    for files, fields in needed.items():
        print(f"rlpost download: {files.repo_id} for {', '.join(fields)}: {files.command(cache_dir)}", file=sys.stderr)
        try:
            folder = files.fetch(cache_dir)
        except GatedRepoError:
            failed += 1
            print(f"  {files.repo_id} is gated: {GATED_HINT.format(repo_id=files.repo_id)}", file=sys.stderr)
            continue
        except Exception as exc:  # noqa: BLE001 - network, unknown repository or file: report and go on
            failed += 1
            print(f"  failed: {type(exc).__name__}: {' '.join(str(exc).split())}", file=sys.stderr)
            continue
        print(f"  -> {folder}", file=sys.stderr)
    if failed:
        print(f"rlpost download: {failed} of {len(needed)} repositories failed (above)", file=sys.stderr)
        return 1
    env = f"HF_HUB_CACHE={shlex.quote(cache_dir)} " if cache_dir is not None else ""
    print(f"rlpost download: done; the recipe now runs offline: {env}HF_HUB_OFFLINE=1 rlpost validate {recipes}")
    return 0
