"""The plugin host of the applications: rlpost's built-in plugin modules and the process-wide host.

The list of built-ins lives here, in the top layer, because it names modules of every layer (the reporting plugin is
an application); :class:`rlpost.core.plugins.PluginHost` takes it as an argument, so the core names no module above
it (docs/design.md, "Layers").
"""

from __future__ import annotations

from types import ModuleType

from rlpost.apps import reporting
from rlpost.components import builtin, prompts
from rlpost.core.plugins import PluginHost
from rlpost.models import flux, sd3, wan

__all__ = ["DEFAULT_PLUGINS", "build_host", "get_host", "reset_host"]

# Core modules that implement hooks; registered first by every host built here, and never blocked.
DEFAULT_PLUGINS: tuple[ModuleType, ...] = (builtin, prompts, sd3, flux, wan, reporting)


def build_host(load_entrypoints: bool = True, extra_plugins: tuple[object, ...] = ()) -> PluginHost:
    """A new plugin host with rlpost's built-ins (:data:`DEFAULT_PLUGINS`) registered first.

    Args:
        load_entrypoints: Load entry points of group ``rlpost`` (False gives built-ins only).
        extra_plugins: Additional plugin objects (modules or instances) to register, e.g. test-local plugins.
    """
    return PluginHost(DEFAULT_PLUGINS, load_entrypoints=load_entrypoints, extra_plugins=extra_plugins)


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
