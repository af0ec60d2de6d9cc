"""Run-time plugin failures that name who failed.

A reward that raises or returns the wrong thing, a lifecycle hook that raises, or plugin state that cannot be saved
without pickle is reported as :class:`PluginRuntimeError` naming the distribution, the plugin, the component or hook,
and what was wrong, so a user knows which ``pip`` package to blame (the same plugin/distribution names that
``rlpost plugins list`` shows, taken from the plugin host).
"""

from __future__ import annotations

import importlib.metadata as md
import types
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from rlpost.core.registry import ContestedComponentError, Registry
from rlpost.core.tensor_tree import split_tensors


class HostView(Protocol):
    """What these helpers read of the plugin host (:class:`rlpost.core.plugins.PluginHost` provides it)."""

    @property
    def hook(self) -> Any:
        """pluggy's hook relay."""

    @property
    def infos(self) -> Mapping[str, Any]:
        """Plugin name -> its ``PluginInfo`` (``distribution`` is read)."""

    def registry(self, key: str) -> Registry[Any]:
        """The component registry of ``key``."""


__all__ = [
    "HostView",
    "PluginRuntimeError",
    "call_hook",
    "check_saveable",
    "collect_state",
    "component_origin",
    "hook_origin",
]


class PluginRuntimeError(RuntimeError):
    """A plugin failed while a run was going on.

    Args:
        distribution: The ``pip`` distribution providing the plugin (``"rlpost"`` for built-ins).
        plugin: The plugin name as ``rlpost plugins list`` shows it.
        where: The component (``reward 'aesthetic'``) or hook (``hook rlpost_after_step``) that failed.
        problem: What was wrong, in one line.
    """

    def __init__(self, distribution: str, plugin: str, where: str, problem: str) -> None:
        self.distribution, self.plugin, self.where, self.problem = distribution, plugin, where, problem
        super().__init__(f"{where} of plugin {plugin!r} (distribution {distribution!r}) failed: {problem}")


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__


def component_origin(host: HostView, kind: str, component: object) -> tuple[str, str]:
    """(distribution, plugin) that registered ``component``'s class under registry ``kind``.

    A component built from a bare ``class_path`` (not registered by any plugin) is credited to the distribution
    that installs its top-level package, and its class path stands in for the plugin name.
    """
    cls = type(component)
    registry = host.registry(kind)
    for name in registry.names():
        try:
            entry = registry.get(name)
        except ContestedComponentError:
            continue
        if entry.cls is cls:
            return entry.distribution, entry.plugin
    top = cls.__module__.split(".")[0]
    dists = md.packages_distributions().get(top, [])
    return (dists[0] if dists else "<unknown>"), f"{cls.__module__}.{cls.__qualname__}"


def hook_origin(host: HostView, plugin_name: str) -> tuple[str, str]:
    """(distribution, plugin) for a plugin registered on ``host`` under ``plugin_name``."""
    info = host.infos.get(plugin_name)
    return (info.distribution if info is not None else "<runtime>"), plugin_name


def _impl_that_raised(host: HostView, hook_name: str, exc: BaseException) -> str | None:
    """The plugin whose implementation of ``hook_name`` the exception came out of (from its traceback)."""
    codes: dict[types.CodeType, str] = {}
    for impl in getattr(host.hook, hook_name).get_hookimpls():
        function = impl.function
        code = getattr(function, "__code__", None) or getattr(getattr(function, "__func__", None), "__code__", None)
        if isinstance(code, types.CodeType):
            codes[code] = impl.plugin_name
    tb = exc.__traceback__
    while tb is not None:  # outermost first: the frame pluggy called, not a helper it called
        plugin: str | None = codes.get(tb.tb_frame.f_code)
        if plugin is not None:
            return plugin
        tb = tb.tb_next
    return None


def call_hook(host: HostView, hook_name: str, **kwargs: Any) -> Any:
    """Call lifecycle hook ``hook_name`` through pluggy; an implementation that raises becomes a
    :class:`PluginRuntimeError` naming its plugin and distribution.

    The hook is called as one pluggy call (ordering, ``tryfirst``/``trylast`` and tracing stay pluggy's); the
    failing implementation is found from the traceback.

    Raises:
        PluginRuntimeError: An implementation raised (``KeyboardInterrupt``/``SystemExit`` pass through).
    """
    try:
        return getattr(host.hook, hook_name)(**kwargs)
    except Exception as exc:
        plugin = _impl_that_raised(host, hook_name, exc)
        distribution, plugin = hook_origin(host, plugin) if plugin is not None else ("<unknown>", "<unknown>")
        raise PluginRuntimeError(distribution, plugin, f"hook {hook_name}", _describe(exc)) from exc


def collect_state(host: HostView, hook_name: str, run: Any) -> dict[str, Any]:
    """Call every ``hook_name`` (``rlpost_save_state``) implementation on its own into one mapping, checking that what
    each added can be checkpointed without pickle (JSON scalars and containers, tensors, numpy arrays).

    Raises:
        PluginRuntimeError: An implementation raised or added a value that cannot be saved; nothing is written.
    """
    state: dict[str, Any] = {}
    # pluggy calls implementations last-registered first (tryfirst/trylast already sorted into the list).
    for impl in reversed(getattr(host.hook, hook_name).get_hookimpls()):
        distribution, plugin = hook_origin(host, impl.plugin_name)
        where = f"hook {hook_name}"
        before = {k: id(v) for k, v in state.items()}
        call: Callable[..., Any] = impl.function
        try:
            call(**{arg: {"run": run, "state": state}[arg] for arg in impl.argnames})
        except Exception as exc:
            raise PluginRuntimeError(distribution, plugin, where, _describe(exc)) from exc
        for key, value in state.items():
            if before.get(key) != id(value):
                problem = check_saveable(value)
                if problem is not None:
                    raise PluginRuntimeError(distribution, plugin, where, f"state[{key!r}]: {problem}")
    return state


def check_saveable(value: Any) -> str | None:
    """Why ``value`` cannot go into a pickle-free checkpoint, or ``None`` when it can."""
    try:
        split_tensors(value, {})
    except TypeError as exc:
        return str(exc)
    return None
