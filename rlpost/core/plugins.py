"""Plugin loading that a user can trust.

* Built-in modules (the ``builtins`` argument; the applications pass ``rlpost.apps.host.DEFAULT_PLUGINS``) are
  registered first, like pytest's default plugins. The core names no module above it: the top layer owns the list.
* Entry points of group ``rlpost`` are loaded **one at a time**: a plugin that fails to import, fails pluggy's
  validation, or raises inside a registration hook is recorded with its name, distribution and exception and
  skipped (none of its hooks or components stay active); the CLI keeps working. First-party plugins use the same
  group, and are recognised by what they are, not by the name a distribution gives itself: an entry point of
  distribution ``rlpost`` whose name and value are one of the ``first_party`` pairs the host is given
  (``rlpost.apps.host`` passes the ones pyproject.toml declares). Any other entry point of a distribution calling
  itself ``rlpost`` is refused without being imported: that name can neither add nor replace a first-party plugin.
* **Built-ins always win, whatever the load order or hook ordering.** Plugins are loaded and their registration
  hooks called in a fixed order: core modules, then first-party entry points, then third-party ones sorted by
  distribution and entry-point name (never ``sys.path`` order, never pluggy's ``tryfirst``/``trylast`` order).
  A component name that is already taken is refused, the refusing plugin is marked ``error`` naming both
  distributions, and the name becomes *contested*: a recipe naming it without qualification fails validation
  (``rlpost:jpeg-compressibility`` or blocking one plugin chooses). A third-party entry point named like a
  first-party one (``rewards`` in another distribution) is refused without being imported and never disables the
  first-party plugin; two third-party distributions using one entry-point name are both refused.
* Environment switches (read when the host is built):

  - ``RLPOST_LOAD_PLUGINS``: comma-separated allowlist of third-party plugin or distribution names; set but empty
    means no third-party plugin loads (llm / datasette convention). First-party plugins are not affected.
  - ``RLPOST_BLOCK_PLUGINS``: comma-separated plugin, distribution or ``distribution:plugin`` names never loaded
    (first-party included).
  - ``RLPOST_DISABLE_PLUGIN_AUTOLOAD=1``: no third-party entry point loads (the test suite sets it, so plugins
    installed on a developer's machine cannot change test results).
  - ``RLPOST_TRACE_PLUGINS=1``: print every hook call, its implementations and results to stderr.

* What plugin code prints while it is imported and registered goes to stderr: stdout is the result of commands such
  as ``rlpost plugins list --json``.

Installing a plugin, or running a recipe that names a ``class_path``, runs that code: treat both like
``pip install``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import os
import sys
import traceback
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pluggy

from rlpost.core import hookspecs
from rlpost.core.api import AdvantageEstimator, Component, Policy, PolicyOptimizer, PromptSource, RewardSource, Sampler
from rlpost.core.plugin_errors import call_hook, collect_state, component_origin
from rlpost.core.registry import Registry, canonical_distribution

if TYPE_CHECKING:
    from rlpost.core.api import Advantages
    from rlpost.core.context import RunContext, RunStatus
    from rlpost.core.contract import RewardScores, Rollout

__all__ = ["ENTRY_POINT_GROUP", "PluginHost", "PluginInfo"]

ENTRY_POINT_GROUP = "rlpost"
FIRST_PARTY_DISTRIBUTION = "rlpost"

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
        builtins: Core modules that implement hooks, registered first under their module names, always (they cannot
            be blocked: rlpost does not work without them). ``rlpost.apps.host.build_host`` passes rlpost's own;
            ``()`` gives a bare host.
        load_entrypoints: Load entry points of group ``rlpost`` (False gives built-ins only).
        extra_plugins: Additional plugin objects (modules or instances) to register, e.g. test-local plugins.
        first_party: rlpost's own entry points, name -> value (``{"rewards": "rlpost_rewards", ...}``): the only
            entry points of distribution ``rlpost`` that load (``rlpost.apps.host.build_host`` passes rlpost's).
    """

    def __init__(
        self,
        builtins: Sequence[ModuleType],
        load_entrypoints: bool = True,
        extra_plugins: tuple[object, ...] = (),
        first_party: Mapping[str, str] | None = None,
    ) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}
        self.registries: dict[str, Registry[Any]] = {
            key: Registry(key, base) for key, base in REGISTRATION_HOOKS.values()
        }
        self._order: list[str] = []  # registered plugin names, in registration order
        self._trace = os.environ.get("RLPOST_TRACE_PLUGINS", "") not in ("", "0")
        if self._trace:
            self._enable_tracing()
        self._builtin_names = tuple(module.__name__ for module in builtins)
        self._first_party = dict(first_party or {})
        # Plugin code runs from here on (imports, registration hooks): anything it prints goes to stderr, so a
        # command's stdout stays its result (``plugins list --json``). Redirected in the host, not in one command,
        # because every command that prints JSON builds the host first.
        with contextlib.redirect_stdout(sys.stderr):
            version = _dist_version(FIRST_PARTY_DISTRIBUTION)
            for module, module_name in zip(builtins, self._builtin_names, strict=True):
                self._register(module, module_name, FIRST_PARTY_DISTRIBUTION, version, module_name, True)
            if load_entrypoints:
                self._load_entrypoints()
            for index, plugin in enumerate(extra_plugins):
                name = getattr(plugin, "__name__", None) or f"{type(plugin).__name__}-{index}"
                if name in self.infos:
                    name = f"<local>:{name}"
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
        self._order.append(name)
        return info

    def _hooknames_of(self, plugin: object) -> Iterator[tuple[str, object]]:
        for caller in self.pm.get_hookcallers(plugin) or []:
            yield caller.name, caller

    def _entry_points(self) -> list[tuple[md.EntryPoint, str, str, bool, str]]:
        """Every ``rlpost`` entry point as (entry point, distribution, version, first-party, where), in load order.

        First-party entry points come first, then third-party ones sorted by (distribution, name): the order of
        ``sys.path`` (which decides ``importlib.metadata``'s order) never decides who gets a name. First-party means
        distribution ``rlpost`` declaring one of the host's ``first_party`` name/value pairs; an entry point of
        another distribution that calls itself ``rlpost`` is kept apart from it (never deduplicated into it), so it
        can be refused and listed whatever its place on ``sys.path``.
        """
        found: dict[tuple[str, str, bool], tuple[md.EntryPoint, str, str, bool, str]] = {}
        for dist in md.distributions():
            dist_name = dist.metadata["Name"] or "<unknown>"
            canonical = canonical_distribution(dist_name)
            for ep in dist.entry_points:
                first_party = canonical == FIRST_PARTY_DISTRIBUTION and self._first_party.get(ep.name) == ep.value
                key = (canonical, ep.name, first_party)
                if ep.group != ENTRY_POINT_GROUP or key in found:
                    continue  # the same distribution twice on sys.path: the first copy is the one Python imports
                found[key] = (ep, dist_name, dist.version or "", first_party, str(dist.locate_file("")))
        return sorted(found.values(), key=lambda t: (not t[3], canonical_distribution(t[1]), t[0].name))

    def _impostor_error(self, ep: md.EntryPoint, where: str) -> str:
        """Why an entry point of a distribution named ``rlpost`` that is not one of rlpost's own was refused."""
        own = self._first_party.get(ep.name)
        what = f"rlpost's own {ep.name!r} is {own!r}" if own else f"rlpost has no plugin {ep.name!r}"
        return (
            f"refused: a distribution named {FIRST_PARTY_DISTRIBUTION!r} in {where} declares entry point "
            f"'{ep.name} = {ep.value}', which is not one of rlpost's own plugins ({what}); a distribution calling "
            f"itself rlpost cannot add or replace a first-party plugin, so it was not loaded (uninstall it, or "
            f"reinstall rlpost if it is a stale copy)"
        )

    def _load_entrypoints(self) -> None:
        allow = _split_env("RLPOST_LOAD_PLUGINS")
        block = _split_env("RLPOST_BLOCK_PLUGINS") or set()
        no_autoload = os.environ.get("RLPOST_DISABLE_PLUGIN_AUTOLOAD", "") not in ("", "0")
        candidates: list[tuple[md.EntryPoint, PluginInfo, bool]] = []
        for ep, dist_name, version, first_party, where in self._entry_points():
            info = PluginInfo(name=ep.name, distribution=dist_name, version=version, source=ep.value)
            names = {ep.name, dist_name, canonical_distribution(dist_name), f"{dist_name}:{ep.name}"}
            if names & block:
                info.status = "blocked"
            elif not first_party and canonical_distribution(dist_name) == FIRST_PARTY_DISTRIBUTION:
                # Checked before the autoload switches: this one would otherwise have loaded as first-party.
                info.status, info.error = "error", self._impostor_error(ep, where)
            elif not first_party and no_autoload and allow is None:
                info.status = "disabled"
            elif not first_party and allow is not None and not (names & allow):
                info.status = "not-allowed"
            candidates.append((ep, info, first_party))
        # Who else wants each entry-point name (among plugins that would load): decided before anything is
        # imported, so neither order nor an import side effect can change the outcome.
        # First-party names stay reserved even when blocked: blocking a built-in must not hand its name over.
        taken = {name: FIRST_PARTY_DISTRIBUTION for name in self._builtin_names}
        for ep, info, first_party in candidates:
            if first_party:
                taken.setdefault(ep.name, info.distribution)
        third: dict[str, list[str]] = {}  # entry-point name -> third-party distributions that would load it
        shared: dict[str, int] = {}  # entry-point name -> number of third-party distributions using it at all
        for ep, info, first_party in candidates:
            if not first_party:
                shared[ep.name] = shared.get(ep.name, 0) + 1
                if info.status == "ok":
                    third.setdefault(ep.name, []).append(info.distribution)
        for ep, info, first_party in candidates:
            if not first_party and info.status == "ok":
                if ep.name in taken:
                    info.status = "error"
                    info.error = (
                        f"entry-point name {ep.name!r} of distribution {info.distribution!r} is taken by first-party "
                        f"distribution {taken[ep.name]!r}; this plugin was not loaded (rename its entry point, or "
                        f"block it with RLPOST_BLOCK_PLUGINS={info.distribution})"
                    )
                elif len(third[ep.name]) > 1:
                    info.status = "error"
                    info.error = (
                        f"entry-point name {ep.name!r} is used by distributions "
                        f"{' and '.join(repr(d) for d in third[ep.name])}; none of them was loaded (block all but "
                        f"one with RLPOST_BLOCK_PLUGINS, or uninstall one)"
                    )
            # A name shared with another distribution is listed qualified (``dist:name``), so both stay visible.
            # One that is not loaded (blocked, ...) never pushes a loaded one off its plain name.
            loading = len(third.get(ep.name, []))
            contested = not first_party and (
                ep.name in taken or loading > 1 or (info.status != "ok" and shared[ep.name] > 1)
            )
            key = f"{info.distribution}:{ep.name}" if contested or ep.name in self.infos else ep.name
            info.name = key
            if info.status != "ok":
                self.infos[key] = info
                continue
            try:
                plugin = ep.load()
            except BaseException as exc:  # noqa: BLE001 - a plugin may even raise SystemExit at import
                if isinstance(exc, KeyboardInterrupt):
                    raise
                info.status, info.error = "error", _format_exc(exc)
                if self._trace:
                    traceback.print_exception(exc, file=sys.stderr)
                self.infos[key] = info
                continue
            self._register(plugin, key, info.distribution, info.version, ep.value, False)

    def _run_registrations(self) -> None:
        """Call each plugin's registration hooks on their own, in load order, crediting components to it.

        The order is the host's (core, first-party, third-party by name, local), not pluggy's call order, so
        ``tryfirst``/``trylast`` cannot make a plugin register before a built-in. A plugin whose registration fails
        (including a refused duplicate name) is removed whole: its components and all its hooks.
        """
        for name in list(self._order):
            info = self.infos[name]
            plugin = self.pm.get_plugin(name)
            if info.status != "ok" or plugin is None:
                continue
            for hook_name, (key, _) in REGISTRATION_HOOKS.items():
                impls = [i for i in getattr(self.pm.hook, hook_name).get_hookimpls() if i.plugin_name == name]
                registry = self.registries[key]
                for impl in impls:
                    registry.set_provenance(info.name, info.distribution)
                    before = set(registry.names())
                    kwargs = {arg: registry for arg in impl.argnames}
                    try:
                        self._traced_call(hook_name, impl.plugin_name, impl.function, kwargs)
                    except Exception as exc:  # noqa: BLE001 - isolate the failing plugin
                        info.status, info.error = "error", _format_exc(exc)
                    info.components.extend(f"{key}:{n}" for n in sorted(set(registry.names()) - before))
                if info.status != "ok":
                    break
            if info.status != "ok":
                self._unload(name)

    def _unload(self, name: str) -> None:
        """Take a failed plugin out entirely: no component it registered and none of its hooks stay active."""
        for registry in self.registries.values():
            registry.remove_plugin(name)
        self.infos[name].components = []
        plugin = self.pm.get_plugin(name)
        if plugin is not None:
            self.pm.unregister(plugin)
        self._order.remove(name)

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
        """pluggy's hook relay (``host.hook.rlpost_after_step(run=..., metrics=...)``); the engine calls the typed
        wrappers below instead."""
        return self.pm.hook

    def component_origin(self, kind: str, component: object) -> tuple[str, str]:
        """(distribution, plugin) that registered ``component``'s class under registry ``kind``."""
        return component_origin(self, kind, component)

    # -------------------------------------------------------------------------------------- lifecycle hooks
    # Typed calls of the lifecycle hooks (tox's plugin manager model): an implementation that raises becomes a
    # PluginRuntimeError naming its plugin and distribution (rlpost.core.plugin_errors).

    def before_run(self, run: RunContext) -> None:
        """Call ``rlpost_before_run``."""
        call_hook(self, "rlpost_before_run", run=run)

    def after_rollout(self, run: RunContext, rollout: Rollout) -> None:
        """Call ``rlpost_after_rollout``."""
        call_hook(self, "rlpost_after_rollout", run=run, rollout=rollout)

    def after_rewards(self, run: RunContext, rollout: Rollout, scores: RewardScores) -> None:
        """Call ``rlpost_after_rewards``."""
        call_hook(self, "rlpost_after_rewards", run=run, rollout=rollout, scores=scores)

    def after_advantages(self, run: RunContext, rollout: Rollout, advantages: Advantages) -> None:
        """Call ``rlpost_after_advantages``."""
        call_hook(self, "rlpost_after_advantages", run=run, rollout=rollout, advantages=advantages)

    def after_step(self, run: RunContext, metrics: Mapping[str, float]) -> None:
        """Call ``rlpost_after_step``."""
        call_hook(self, "rlpost_after_step", run=run, metrics=metrics)

    def save_state(self, run: RunContext) -> dict[str, Any]:
        """Collect every ``rlpost_save_state`` implementation's entries, each checked to be checkpointable.

        Raises:
            PluginRuntimeError: An implementation raised or added a value that cannot be saved without pickle.
        """
        return collect_state(self, "rlpost_save_state", run)

    def load_state(self, run: RunContext, state: Mapping[str, Any]) -> None:
        """Call ``rlpost_load_state`` with what :meth:`save_state` collected."""
        call_hook(self, "rlpost_load_state", run=run, state=state)

    def after_run(self, run: RunContext, status: RunStatus) -> None:
        """Call ``rlpost_after_run`` with how the run ended (:class:`~rlpost.core.context.RunStatus`)."""
        call_hook(self, "rlpost_after_run", run=run, status=status)

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


def _dist_version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "0+unknown"
