"""Plugin loading that a user can trust.

* Built-in modules (``DEFAULT_PLUGINS``) are registered by import, like pytest's default plugins.
* Entry points of group ``rlpost`` are loaded **one at a time**: a plugin that fails to import, fails pluggy's
  validation, or raises inside a registration hook is recorded with its name, distribution and exception and
  skipped; the CLI keeps working. First-party plugins (distribution ``rlpost``) use the same group.
* Environment switches (read when the host is built):

  - ``RLPOST_LOAD_PLUGINS``: comma-separated allowlist of third-party plugin or distribution names; set but empty
    means no third-party plugin loads (llm / datasette convention). First-party plugins are not affected.
  - ``RLPOST_BLOCK_PLUGINS``: comma-separated plugin or distribution names never loaded (first-party included).
  - ``RLPOST_DISABLE_PLUGIN_AUTOLOAD=1``: no third-party entry point loads (the test suite sets it, so plugins
    installed on a developer's machine cannot change test results).
  - ``RLPOST_TRACE_PLUGINS=1``: print every hook call, its implementations and results to stderr.

Installing a plugin, or running a recipe that names a ``class_path``, runs that code: treat both like
``pip install``.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import sys
import traceback
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import pluggy

from rlpost import hookspecs
from rlpost.api import AdvantageEstimator, Component, Policy, PolicyOptimizer, PromptSource, RewardSource, Sampler
from rlpost.registry import DuplicateComponentError, Registry

__all__ = ["DEFAULT_PLUGINS", "ENTRY_POINT_GROUP", "PluginHost", "PluginInfo", "get_host", "reset_host"]

ENTRY_POINT_GROUP = "rlpost"
FIRST_PARTY_DISTRIBUTION = "rlpost"

# Core modules that implement hooks; always registered (they cannot be blocked: rlpost does not work without them).
DEFAULT_PLUGINS: tuple[str, ...] = (
    "rlpost.builtin",
    "rlpost.prompts",
    "rlpost.models.sd3",
    "rlpost.digits",
    "rlpost.reporting",
)

# Registration hook name -> (registry key, base class). Order is the order of ``rlpost plugins list`` columns.
REGISTRATION_HOOKS: dict[str, tuple[str, type[Component]]] = {
    "rlpost_register_samplers": ("sampler", Sampler),
    "rlpost_register_advantage_estimators": ("advantage", AdvantageEstimator),
    "rlpost_register_reward_sources": ("reward", RewardSource),
    "rlpost_register_optimizers": ("optimizer", PolicyOptimizer),
    "rlpost_register_models": ("model", Policy),
    "rlpost_register_prompt_sources": ("prompts", PromptSource),
}


@dataclass
class PluginInfo:
    """What ``rlpost plugins list`` reports about one plugin.

    Attributes:
        name: Plugin name (entry-point name, or module name for built-ins).
        distribution: Providing distribution, ``"rlpost"`` for first-party and built-ins.
        version: Distribution version.
        source: Entry-point value or module name.
        builtin: True for core modules registered by import.
        status: ``"ok"``, ``"blocked"``, ``"not-allowed"``, ``"disabled"`` or ``"error"``.
        error: ``"ExceptionType: message"`` when status is ``"error"`` (or a component was rejected).
        hooks: Hook names the plugin implements.
        components: ``"kind:name"`` for every component it registered.
    """

    name: str
    distribution: str
    version: str
    source: str
    builtin: bool = False
    status: str = "ok"
    error: str | None = None
    hooks: list[str] = field(default_factory=list)
    components: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)


def _split_env(name: str) -> set[str] | None:
    raw = os.environ.get(name)
    if raw is None:
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


def _format_exc(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class PluginHost:
    """Owns the pluggy ``PluginManager``, the plugin inventory and the component registries.

    Args:
        load_entrypoints: Load entry points of group ``rlpost`` (False gives built-ins only).
        extra_plugins: Additional plugin objects (modules or instances) to register, e.g. test-local plugins.
    """

    def __init__(self, load_entrypoints: bool = True, extra_plugins: tuple[object, ...] = ()) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}
        self.registries: dict[str, Registry[Any]] = {
            key: Registry(key, base) for key, base in REGISTRATION_HOOKS.values()
        }
        self._trace = os.environ.get("RLPOST_TRACE_PLUGINS", "") not in ("", "0")
        if self._trace:
            self._enable_tracing()
        for module_name in DEFAULT_PLUGINS:
            module = importlib.import_module(module_name)
            self._register(module, module_name, FIRST_PARTY_DISTRIBUTION, _dist_version("rlpost"), module_name, True)
        if load_entrypoints:
            self._load_entrypoints()
        for index, plugin in enumerate(extra_plugins):
            name = getattr(plugin, "__name__", None) or f"{type(plugin).__name__}-{index}"
            self._register(plugin, name, "<local>", "", repr(plugin), False)
        self._run_registrations()

    # ------------------------------------------------------------------------------------------------ loading
    def _register(self, plugin: object, name: str, dist: str, version: str, source: str, builtin: bool) -> PluginInfo:
        info = PluginInfo(name=name, distribution=dist, version=version, source=source, builtin=builtin)
        self.infos[name] = info
        try:
            self.pm.register(plugin, name=name)
            # check_pending per plugin: a misspelt hook in one plugin must not take down the others.
            self.pm.check_pending()
        except Exception as exc:  # noqa: BLE001 - isolate any plugin failure
            if self.pm.is_registered(plugin):
                self.pm.unregister(plugin)
            info.status, info.error = "error", _format_exc(exc)
            return info
        info.hooks = sorted(impl_name for impl_name, _ in self._hooknames_of(plugin))
        return info

    def _hooknames_of(self, plugin: object) -> Iterator[tuple[str, object]]:
        for caller in self.pm.get_hookcallers(plugin) or []:
            yield caller.name, caller

    def _load_entrypoints(self) -> None:
        allow = _split_env("RLPOST_LOAD_PLUGINS")
        block = _split_env("RLPOST_BLOCK_PLUGINS") or set()
        no_autoload = os.environ.get("RLPOST_DISABLE_PLUGIN_AUTOLOAD", "") not in ("", "0")
        seen: set[tuple[str, str]] = set()
        for dist in md.distributions():
            dist_name = dist.metadata["Name"] or "<unknown>"
            for ep in dist.entry_points:
                if ep.group != ENTRY_POINT_GROUP or (dist_name, ep.name) in seen:
                    continue
                seen.add((dist_name, ep.name))
                first_party = _canonical(dist_name) == FIRST_PARTY_DISTRIBUTION
                info = PluginInfo(name=ep.name, distribution=dist_name, version=dist.version or "", source=ep.value)
                if ep.name in block or dist_name in block:
                    info.status = "blocked"
                elif not first_party and no_autoload and allow is None:
                    info.status = "disabled"
                elif not first_party and allow is not None and not ({ep.name, dist_name} & allow):
                    info.status = "not-allowed"
                if info.status != "ok":
                    self.infos.setdefault(ep.name, info)
                    continue
                if ep.name in self.infos and self.infos[ep.name].status == "ok":
                    info.status = "error"
                    info.error = (
                        f"plugin name {ep.name!r} already used by distribution {self.infos[ep.name].distribution!r}"
                    )
                    self.infos[f"{dist_name}:{ep.name}"] = info
                    continue
                try:
                    plugin = ep.load()
                except BaseException as exc:  # noqa: BLE001 - a plugin may even raise SystemExit at import
                    if isinstance(exc, KeyboardInterrupt):
                        raise
                    info.status, info.error = "error", _format_exc(exc)
                    if self._trace:
                        traceback.print_exception(exc, file=sys.stderr)
                    self.infos[ep.name] = info
                    continue
                self._register(plugin, ep.name, dist_name, dist.version or "", ep.value, False)

    def _run_registrations(self) -> None:
        """Call each registration hook implementation on its own, crediting components to their plugin."""
        for hook_name, (key, _) in REGISTRATION_HOOKS.items():
            registry = self.registries[key]
            caller = getattr(self.pm.hook, hook_name)
            for impl in caller.get_hookimpls():
                info = self.infos.get(impl.plugin_name)
                if info is None or info.status != "ok":
                    continue
                registry.set_provenance(info.name, info.distribution)
                before = set(registry.names())
                kwargs = {arg: registry for arg in impl.argnames}
                try:
                    self._traced_call(hook_name, impl.plugin_name, impl.function, kwargs)
                except DuplicateComponentError as exc:
                    info.error = _format_exc(exc)
                    info.status = "error"
                except Exception as exc:  # noqa: BLE001 - isolate the failing plugin
                    info.status, info.error = "error", _format_exc(exc)
                info.components.extend(f"{key}:{name}" for name in sorted(set(registry.names()) - before))

    def _traced_call(self, hook: str, plugin: str, function: Any, kwargs: Mapping[str, Any]) -> Any:
        if self._trace:
            print(f"[rlpost trace] {hook} -> {plugin}", file=sys.stderr)
        result = function(**kwargs)
        if self._trace:
            print(f"[rlpost trace] {hook} <- {plugin}: {result!r}", file=sys.stderr)
        return result

    def _enable_tracing(self) -> None:
        def before(hook_name: str, impls: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
            names = ", ".join(impl.plugin_name for impl in impls)
            print(f"[rlpost trace] {hook_name}({', '.join(kwargs)}) -> [{names}]", file=sys.stderr)

        def after(outcome: Any, hook_name: str, impls: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
            print(f"[rlpost trace] {hook_name} <- {outcome.get_result()!r}", file=sys.stderr)

        self.pm.add_hookcall_monitoring(before, after)

    # ------------------------------------------------------------------------------------------------ queries
    def registry(self, key: str) -> Registry[Any]:
        """The registry for ``key`` (``sampler``, ``advantage``, ``reward``, ``optimizer``, ``model``, ``prompts``)."""
        return self.registries[key]

    def plugins(self, include_builtin: bool = False) -> list[PluginInfo]:
        """Plugin inventory, sorted by name; built-in core modules only with ``include_builtin``."""
        return sorted(
            (info for info in self.infos.values() if include_builtin or not info.builtin), key=lambda i: i.name
        )

    @property
    def hook(self) -> Any:
        """pluggy's hook relay (``host.hook.rlpost_after_step(run=..., metrics=...)``)."""
        return self.pm.hook

    def register_plugin(self, plugin: object, name: str) -> None:
        """Register a lifecycle-only plugin object at run time (e.g. a progress bar or a test probe).

        Components cannot be registered this way after start-up; use a registration hook.
        """
        self.pm.register(plugin, name=name)
        self.pm.check_pending()

    def unregister_plugin(self, name: str) -> None:
        """Remove a plugin registered with :meth:`register_plugin`."""
        plugin = self.pm.get_plugin(name)
        if plugin is not None:
            self.pm.unregister(plugin)


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _dist_version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "0+unknown"


_HOST: PluginHost | None = None


def get_host() -> PluginHost:
    """The process-wide plugin host, built lazily on first use (importing rlpost loads no plugin)."""
    global _HOST
    if _HOST is None:
        _HOST = PluginHost()
    return _HOST


def reset_host(host: PluginHost | None = None) -> None:
    """Replace (or clear, with ``None``) the process-wide host; used by tests."""
    global _HOST
    _HOST = host
