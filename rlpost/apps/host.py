"""The plugin host of the applications: rlpost's built-in plugin modules, its first-party entry points and the
process-wide host.

The list of built-ins lives here, in the top layer, because it names modules of every layer (the reporting plugin is
an application); :class:`rlpost.core.plugins.PluginHost` takes it as an argument, so the core names no module above
it (docs/design.md, "Layers").
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

from rlpost.apps import reporting
from rlpost.components import builtin, prompts
from rlpost.core.plugins import PluginHost
from rlpost.models import flux, sd3, wan

__all__ = ["DEFAULT_PLUGINS", "FIRST_PARTY_PLUGINS", "build_host", "get_host", "plugin_output_to_stderr", "reset_host"]

# Core modules that implement hooks; registered first by every host built here, and never blocked.
DEFAULT_PLUGINS: tuple[ModuleType, ...] = (builtin, prompts, sd3, flux, wan, reporting)

# rlpost's own entry points (group ``rlpost``), exactly as pyproject.toml declares them under
# [project.entry-points.rlpost] (tests/unit/test_plugin_identity.py keeps the two equal). Only these, declared by
# distribution ``rlpost``, load as first-party: a distribution that merely calls itself ``rlpost`` is refused.
FIRST_PARTY_PLUGINS: dict[str, str] = {
    "rewards": "rlpost_rewards",
    "treegrpo": "rlpost_treegrpo",
    "dancegrpo": "rlpost_dancegrpo",
    "mixgrpo": "rlpost_mixgrpo",
    "ddpo": "rlpost_ddpo",
    "digits": "rlpost_digits",
    "qwenimage": "rlpost_qwenimage",
    "nft": "rlpost_nft",
    "awm": "rlpost_awm",
    "dgpo": "rlpost_dgpo",
    "tempflow": "rlpost_tempflow",
    "branchgrpo": "rlpost_branchgrpo",
    "flowgrpo": "rlpost_flowgrpo",
    "treenft": "rlpost_treenft",
}


def build_host(load_entrypoints: bool = True, extra_plugins: tuple[object, ...] = ()) -> PluginHost:
    """A new plugin host with rlpost's built-ins (:data:`DEFAULT_PLUGINS`) registered first.

    Args:
        load_entrypoints: Load entry points of group ``rlpost`` (False gives built-ins only).
        extra_plugins: Additional plugin objects (modules or instances) to register, e.g. test-local plugins.
    """
    return PluginHost(
        DEFAULT_PLUGINS,
        load_entrypoints=load_entrypoints,
        extra_plugins=extra_plugins,
        first_party=FIRST_PARTY_PLUGINS,
    )


_HOST: PluginHost | None = None


def get_host() -> PluginHost:
    """The process-wide plugin host, built lazily on first use (importing rlpost loads no plugin)."""
    global _HOST
    if _HOST is None:
        _HOST = build_host()
    return _HOST


def reset_host(host: PluginHost | None = None) -> None:
    """Replace (or clear, with ``None``) the process-wide host; used by tests."""
    global _HOST
    _HOST = host


@contextmanager
def plugin_output_to_stderr() -> Iterator[None]:
    """Point file descriptor 1 at stderr for the duration, for a command whose stdout is its result.

    The host already sends what plugin code prints through ``sys.stdout`` to stderr; this also covers a plugin that
    writes to the descriptor itself (``os.write(1, ...)``, a subprocess it starts). Process-wide, so only for a
    command's start-up, never inside the library. Without a descriptor 1 it does nothing.
    """
    sys.stdout.flush()
    try:
        saved: int | None = os.dup(1)
    except OSError:  # no stdout at all: nothing to protect
        saved = None
    try:
        if saved is not None:
            os.dup2(2, 1)
        yield
    finally:
        if saved is not None:
            sys.stderr.flush()
            os.dup2(saved, 1)
            os.close(saved)
