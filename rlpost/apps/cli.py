"""The ``rlpost`` command line.

    rlpost train    --recipe R.yaml [--recipe overlay.yaml ...] [--a.b value ...] [--print_config]
                    [--resume latest|RUN_DIR|CHECKPOINT_DIR]
    rlpost train    --nproc_per_node N --recipe R.yaml ...   (N ranks on this host; torchrun's launcher)
    rlpost train    --help | --sampler.help NAME  (likewise --model/--prompts/--rewards/--advantage/--optimizer)
    rlpost validate --recipe R.yaml [--recipe overlay.yaml ...] [--a.b value ...]
    rlpost download --recipe R.yaml [--recipe overlay.yaml ...] [--dry-run] [--dir DIR]   (Hub files into the HF cache)
    rlpost sample   --run DIR [--checkpoint latest|PATH] (--prompt "..." ... | --prompts-file F) --out DIR
                    [--num-steps N] [--seed S] [--batch-size B] [--device D]
    rlpost export   --run DIR --out DIR [--checkpoint latest|PATH] [--license ID] [--force] [--base_model ID]
                    [--push_to_hub REPO [--private]]
    rlpost plugins list [--json] [--all]
    rlpost recipes  list [--json] | copy NAME DEST [--force]     (the shipped recipes, to start your own from)
    rlpost --version
    rlpost COMMAND ... --traceback    (or RLPOST_TRACEBACK=1): a failure's full traceback, e.g. a plugin's that raised
    rlpost bench    --recipe BENCH.yaml [--out DIR] [--bench.KEY VALUE ...]   (rlpost.bench)

Recipe files and ``--a.b value`` options are merged by jsonargparse in command-line order: a later file or option
overlays earlier ones (values are parsed as YAML; ``--sampler.k 4`` means ``sampler.init_args.k``).
``rlpost train --help`` lists every option with the help text taken from the components' docstrings;
``--sampler.help tree`` lists one component's options.
Third-party progress bars and notices are silenced; ``RLPOST_VERBOSE=1`` keeps them.

Exit status: 0 done; 2 a bad recipe, option or file (each problem named); 3 stopped by a non-finite guard;
4 a plugin failed at run time (``--traceback`` or ``RLPOST_TRACEBACK=1`` prints its traceback); 5 nothing to do
(``--resume`` of a run that already reached ``run.max_steps``: raise it to train further).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

import yaml
from jsonargparse import ArgumentParser, Namespace
from rich.console import Console
from rich.table import Table

from rlpost.apps.host import get_host
from rlpost.core.plugin_errors import PluginRuntimeError
from rlpost.core.plugins import PluginHost
from rlpost.core.user_files import UserFileError
from rlpost.engine.checkpoint import CheckpointError, RunFinishedError
from rlpost.engine.guards import NonFiniteError
from rlpost.engine.recipe import Recipe, RecipeError, build_parser, parse_recipe_args, validate

__all__ = ["main"]


TRACEBACK_ENV = "RLPOST_TRACEBACK"
"""Set to ``1`` to print the full traceback of a failure (as ``--traceback`` does), e.g. of a plugin that raised."""

EXIT_NOTHING_TO_DO = 5
"""``rlpost train --resume`` of a run whose checkpoint already reached ``run.max_steps``."""


class UsageError(Exception):
    """Bad command-line usage."""


def _add_cli_options(parser: ArgumentParser, command: str) -> None:
    """The options of ``train``/``validate`` that are neither recipe fields nor ``--recipe`` (which is the recipe
    parser's own ``ActionConfigFile``, :func:`rlpost.engine.recipe.build_parser`). ``--traceback`` is listed for
    the help text only: :func:`main` takes it off the command line of every command."""
    group = parser.add_argument_group("command line", "what is done with the recipe")
    if command == "train":
        group.add_argument(
            "--resume", type=str | None, default=None, help="latest, a run directory or a checkpoint directory"
        )
        group.add_argument("--print_config", action="store_true", help="print the resolved recipe and exit")
    group.add_argument(
        "--traceback", action="store_true", help=f"print a failure's full traceback (also {TRACEBACK_ENV}=1)"
    )


def _load(args: Sequence[str], host: PluginHost, command: str = "train") -> tuple[Recipe | None, Namespace | None]:
    """Parse and validate a ``train``/``validate`` command line with jsonargparse (:func:`parse_recipe_args`).
    Returns ``(None, None)`` after a help text was printed (``--help``, ``--KEY.help NAME``); jsonargparse prints it
    and exits, and it goes to stdout here without reST double backticks."""
    parser = build_parser(prog=f"rlpost {command}")
    if command == "validate":
        parser.description = (
            "Validate a recipe without loading any model: every problem at once, each naming its field; every option "
            "below can be set in the recipe YAML or as --a.b VALUE."
        )
    _add_cli_options(parser, command)
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            cfg, namespace = parse_recipe_args(parser, args, host)
    except SystemExit as exc:  # jsonargparse's help actions exit after printing
        sys.stdout.write(buffer.getvalue().replace("``", ""))
        if exc.code not in (None, 0):
            raise UsageError(f"bad command line (exit status {exc.code})") from None
        return None, None
    return validate(cfg, host), namespace


class _BelowError(logging.Filter):
    """Drops a third-party logger's records below ERROR (its level may be reset on import; a filter stays)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


_QUIET = _BelowError()
QUIET_LOGGERS = ("DeepSpeed",)
"""Loggers that print start-up notices (DeepSpeed: "Setting accelerator to CPU") into a normal run."""


def _quiet_third_party() -> None:
    """Silence third-party progress bars and notices in normal runs (``RLPOST_VERBOSE=1`` keeps them): the model
    libraries' own tqdm bars (e.g. "Writing model shards" when the tiny model is built) and info/warning logs.
    Environment defaults only take effect for libraries not yet imported, which is why the CLI sets them first;
    a variable the user set is kept."""
    if os.environ.get("RLPOST_VERBOSE", "") not in ("", "0"):
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers and huggingface_hub bars
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    for name in QUIET_LOGGERS:
        logger = logging.getLogger(name)
        if _QUIET not in logger.filters:
            logger.addFilter(_QUIET)


def _print_derived(recipe: Recipe, console: Console) -> None:
    table = Table(title="derived quantities (per training step)", show_header=False)
    for key, value in recipe.derived().items():
        table.add_row(key, str(value))
    console.print(table)


def cmd_validate(args: Sequence[str]) -> int:
    """Validate recipes without loading any model; exit 0 when valid, 2 with every problem listed otherwise."""
    console = Console(stderr=True)
    recipe, _ = _load(args, get_host(), "validate")
    if recipe is None:
        return 0
    _print_derived(recipe, console)
    console.print(
        f"[green]recipe OK[/green]: sampler={recipe.sampler.name} advantage={recipe.advantage.name} "
        f"optimizer={recipe.optimizer.name} rewards={[r.name for r in recipe.rewards]}"
    )
    return 0


NPROC_OPTIONS = ("--nproc_per_node", "--nproc-per-node")


def _nproc(args: Sequence[str]) -> tuple[int | None, list[str]]:
    """``--nproc_per_node N`` (or ``=N``) taken out of a ``train`` command line: ``(N, the rest)``; ``(None, args)``
    without it."""
    rest, nproc = list(args), None
    for i, arg in enumerate(rest):
        name, eq, value = arg.partition("=")
        if name in NPROC_OPTIONS:
            if not eq:
                if i + 1 >= len(rest):
                    raise UsageError(f"{name}: give the number of processes")
                value = rest[i + 1]
            del rest[i : i + (1 if eq else 2)]
            if not value.isdigit() or int(value) < 1:
                raise UsageError(f"{name}: expected a positive number of processes, got {value!r}")
            nproc = int(value)
            break
    return nproc, rest


def _launch_ranks(nproc: int, args: Sequence[str]) -> int:
    """Start ``nproc`` ranks of ``rlpost train ARGS`` on this host with torch's elastic launcher (the API behind
    ``torchrun``: ``torch.distributed.run.run``), standalone: a local rendezvous on a free port. Each rank reads
    ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` as under ``torchrun -m rlpost.apps.cli train``."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    launch = parse_args(["--standalone", "--nproc_per_node", str(nproc), "-m", "rlpost.apps.cli", "train", *args])  # type: ignore[no-untyped-call]
    try:
        run(launch)  # type: ignore[no-untyped-call]
    except ChildFailedError as exc:
        ranks = ", ".join(f"rank {rank} exit status {f.exitcode}" for rank, f in sorted(exc.failures.items()))
        print(f"rlpost train: {ranks}", file=sys.stderr)
        return max(f.exitcode for f in exc.failures.values()) or 1
    return 0


def cmd_train(args: Sequence[str]) -> int:
    """Validate the recipe, print derived quantities, and run the training loop (``--nproc_per_node N``: on N ranks
    of this host, started by torch's elastic launcher; the recipe needs a ``distributed`` section)."""
    from rlpost.apps.progress import RichProgress
    from rlpost.engine.runner import Runner

    nproc, args = _nproc(args)
    if nproc is not None and "WORLD_SIZE" not in os.environ:
        return _launch_ranks(nproc, args)
    host = get_host()
    recipe, namespace = _load(args, host)
    if recipe is None or namespace is None:
        return 0
    if namespace.print_config:
        sys.stdout.write(yaml.safe_dump(recipe.config, sort_keys=False))
        return 0
    console = Console(stderr=True)
    if os.environ.get("RANK", "0") == "0":  # only the main process prints under torchrun / deepspeed
        _print_derived(recipe, console)
    runner = Runner(recipe, host, resume=namespace.resume)
    progress: RichProgress | None = None
    if recipe.run.progress and runner.ctx.is_main_process:
        progress = RichProgress(console)
        host.register_plugin(progress, name="rlpost.apps.progress")
        runner.phases.listeners.append(progress)  # loading, evaluations and checkpoints show as phases
    try:
        runner.run()
    finally:
        host.unregister_plugin("rlpost.apps.progress")
        if progress is not None:
            progress.phases.close()
    if runner.ctx.is_main_process:  # also without the progress bar: a run ends with at least one line saying so
        if runner.status == "stopped":  # eval.alarm.stop ended the run early
            what = f"stopped by the reward-hacking alarm after {runner.ctx.step} step(s)"
        else:
            what = f"completed {runner.ctx.step} step(s)"
        console.print(f"rlpost train: {what}; run directory {runner.rundir.path}")
    return 0


def cmd_sample(argv: Sequence[str]) -> int:
    """Generate PNGs from a run's checkpoint with the deterministic ODE sampler."""
    from rlpost.apps.sample import sample_run
    from rlpost.core.user_files import MAX_PROMPTS_FILE_BYTES, UserFileError, read_nonblank_lines

    parser = argparse.ArgumentParser(prog="rlpost sample", description=cmd_sample.__doc__)
    parser.add_argument("--run", required=True, help="the run directory")
    parser.add_argument("--checkpoint", default="latest", help="latest (default) or a checkpoint directory")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    parser.add_argument(
        "--prompts-file", help=f"a UTF-8 text file with one prompt per line (at most {MAX_PROMPTS_FILE_BYTES} bytes)"
    )
    parser.add_argument("--out", required=True, help="output directory for the PNGs")
    parser.add_argument("--num-steps", type=int, default=None, help="ODE steps (default: the recipe's eval NFE)")
    parser.add_argument("--seed", type=int, default=0, help="image i uses seed + i")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--device", default=None, help="default: the recipe's run.device")
    ns = parser.parse_args(argv)
    prompts = list(ns.prompt)
    if ns.prompts_file:  # read before the run is opened: a bad file is refused without loading anything
        try:
            prompts += read_nonblank_lines(ns.prompts_file, "prompts file", MAX_PROMPTS_FILE_BYTES)
        except UserFileError as exc:
            raise UsageError(f"--prompts-file: {exc}") from None
    if not prompts:
        raise UsageError("give --prompt TEXT (repeatable) or --prompts-file FILE")
    paths = sample_run(
        Path(ns.run), get_host(), prompts, Path(ns.out), ns.checkpoint, ns.num_steps, ns.seed, ns.batch_size, ns.device
    )
    print(f"wrote {len(paths)} image(s) to {ns.out}", file=sys.stderr)
    return 0


def cmd_export(argv: Sequence[str]) -> int:
    """Write a run's diffusers-loadable weights (LoRA or transformer/) with a model card."""
    from rlpost.apps.export import export_run, hub_repo_id, push_to_hub

    parser = argparse.ArgumentParser(prog="rlpost export", description=cmd_export.__doc__)
    parser.add_argument("--run", required=True, help="the run directory")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--checkpoint", default="latest", help="latest (default) or a checkpoint directory")
    parser.add_argument(
        "--license",
        default=None,
        help="license id for the model card (e.g. apache-2.0); default: the base model's, else 'other'",
    )
    parser.add_argument(
        "--force", action="store_true", help="overwrite files already in --out (by default the export refuses them)"
    )
    parser.add_argument(
        "--base_model",
        default=None,
        type=hub_repo_id,
        help="the base model's Hub id (org/name) for the model card, when the run loaded it from a local directory",
    )
    parser.add_argument(
        "--push_to_hub",
        default=None,
        type=hub_repo_id,
        metavar="REPO",
        help="also upload the export to this Hugging Face Hub model repository (org/name; created when missing)",
    )
    parser.add_argument("--private", action="store_true", help="with --push_to_hub: create the repository private")
    ns = parser.parse_args(argv)
    out = export_run(
        Path(ns.run), Path(ns.out), ns.checkpoint, license=ns.license, force=ns.force, base_model=ns.base_model
    )
    print(f"exported to {out}", file=sys.stderr)
    if ns.push_to_hub is not None:
        print(f"pushed to {push_to_hub(out, ns.push_to_hub, private=ns.private)}", file=sys.stderr)
    return 0


def cmd_plugins(argv: Sequence[str]) -> int:
    """List plugins with their version, components, hooks, status and load error."""
    from rlpost.apps.host import plugin_output_to_stderr

    parser = argparse.ArgumentParser(prog="rlpost plugins", description=cmd_plugins.__doc__)
    sub = parser.add_subparsers(dest="action", required=True)
    ls = sub.add_parser("list", help="list installed plugins", description=cmd_plugins.__doc__)
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.add_argument("--all", action="store_true", help="include core built-in modules")
    ns = parser.parse_args(argv)
    with plugin_output_to_stderr():  # stdout is the listing: what plugins write while loading is not part of it
        infos = get_host().plugins(include_builtin=ns.all)
    if ns.json:
        print(json.dumps([info.to_json() for info in infos], indent=2))
        return 0
    table = Table(title="rlpost plugins")
    for column in ("name", "distribution", "version", "status", "components", "hooks"):
        table.add_column(column)
    for info in infos:
        status = info.status if info.error is None else f"{info.status}: {info.error}"
        table.add_row(
            info.name, info.distribution, info.version, status, "\n".join(info.components), "\n".join(info.hooks)
        )
    console = Console()
    if not console.is_terminal:  # piped or redirected: as wide as the table needs, never truncated to 80 columns
        console = Console(width=max(80, Console(width=100_000).measure(table).maximum))
    console.print(table)
    return 0


def cmd_recipes(argv: Sequence[str]) -> int:
    """List the shipped recipes, or copy one to edit it (:mod:`rlpost.apps.recipes_cmd`)."""
    from rlpost.apps.recipes_cmd import cmd_recipes as recipes_main

    return recipes_main(argv)


def cmd_download(argv: Sequence[str]) -> int:
    """Fetch every Hub file a recipe needs into the Hugging Face cache (:mod:`rlpost.apps.download`)."""
    from rlpost.apps.download import cmd_download as download_main

    return download_main(argv)


def cmd_bench(argv: Sequence[str]) -> int:
    """Run TreeGRPO, DanceGRPO, MixGRPO and DDPO interleaved in one process and report speed and rewards."""
    from rlpost.bench import main as bench_main

    return bench_main(argv)


COMMANDS = {
    "train": cmd_train,
    "validate": cmd_validate,
    "download": cmd_download,
    "sample": cmd_sample,
    "export": cmd_export,
    "plugins": cmd_plugins,
    "recipes": cmd_recipes,
    "bench": cmd_bench,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rlpost`` console script; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    # The ``deepspeed`` launcher inserts --local_rank=N before the subcommand; ranks are read from LOCAL_RANK.
    args = [a for a in args if not a.startswith(("--local_rank=", "--local-rank="))]
    show_traceback = "--traceback" in args or os.environ.get(TRACEBACK_ENV, "") not in ("", "0")
    args = [a for a in args if a != "--traceback"]  # any command, anywhere on the line
    if args and args[0] in ("--version", "-V"):
        import rlpost

        print(f"rlpost {rlpost.__version__}")
        return 0
    if args and args[0] in ("-h", "--help"):
        print(__doc__.strip().replace("``", ""))
        return 0
    if not args or args[0] not in COMMANDS:
        print(__doc__.strip().replace("``", ""), file=sys.stderr)
        if args and args[0] not in ("-h", "--help"):
            print(f"\nrlpost: unknown command {args[0]!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
            return 2
        return 0 if args else 2
    if args[0] in ("train", "sample", "export", "bench"):
        _quiet_third_party()

    def fail(exc: BaseException, status: int, line: str) -> int:
        """One line naming the problem (after the traceback, when asked for); the exit status."""
        if show_traceback:
            traceback.print_exception(exc, file=sys.stderr)
        print(f"rlpost {args[0]}: {line}", file=sys.stderr)
        return status

    try:
        return COMMANDS[args[0]](args[1:])
    except RecipeError as exc:
        return fail(exc, 2, str(exc))
    except RunFinishedError as exc:  # before CheckpointError, its base: not a failure, a distinct status
        return fail(exc, EXIT_NOTHING_TO_DO, str(exc))
    except (UsageError, FileExistsError, CheckpointError, UserFileError) as exc:  # each names its file or option
        return fail(exc, 2, str(exc))
    except OSError as exc:  # a file the command reads or writes failed (disk full, permissions): its message names it
        return fail(exc, 2, str(exc))
    except NonFiniteError as exc:
        return fail(exc, 3, f"stopped by a non-finite guard: {exc}")
    except PluginRuntimeError as exc:  # names distribution, plugin and component/hook; its own error on request
        hint = "" if show_traceback else f" (--traceback or {TRACEBACK_ENV}=1 shows the plugin's traceback)"
        return fail(exc, 4, f"{exc}{hint}")


if __name__ == "__main__":
    sys.exit(main())
