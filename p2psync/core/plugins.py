"""Plugin manager and the registry of trainer sources, engine targets and transports.

Built-in adapters and third-party packages register alike, through the
`p2psync` entry-point group. Set `P2PSYNC_DISABLE_PLUGIN_AUTOLOAD=1` to load only
the entry points of p2psync itself.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import pluggy

from . import hookspecs
from .engine import EngineTarget
from .errors import OptionsError, PluginError
from .source import TrainerSource
from .transport import Transport

AUTOLOAD_ENV = "P2PSYNC_DISABLE_PLUGIN_AUTOLOAD"
#: Each kind of registered class, and the protocol class it must subclass.
PROTOCOLS: dict[str, type] = {"trainer_sources": TrainerSource, "engine_targets": EngineTarget, "transports": Transport}
KINDS = tuple(PROTOCOLS)


@dataclass(frozen=True)
class Registration:
    """One registered class and the package it came from."""

    kind: str
    name: str
    cls: type
    package: str
    version: str

    def dependency_status(self) -> tuple[bool, str]:
        """Whether every module the class requires imports, and if not, why."""
        for module in getattr(self.cls, "requires", ()):
            try:
                importlib.import_module(module)
            except Exception as exc:  # any import failure means "not usable here"
                return False, f"{module}: {type(exc).__name__}: {exc}"
        return True, ""


@dataclass
class Registry:
    """Registered classes by kind and name."""

    entries: dict[str, dict[str, Registration]] = field(default_factory=lambda: {k: {} for k in KINDS})

    def add(self, kind: str, cls: type, package: str, version: str) -> None:
        """Register `cls` as a class of `kind`: it must subclass that kind's protocol class
        and have a `name` no other class of the kind has."""
        protocol = PROTOCOLS[kind]
        if not (isinstance(cls, type) and issubclass(cls, protocol)):
            raise PluginError(
                f"{kind[:-1].replace('_', ' ')} {getattr(cls, '__qualname__', cls)!r} from package {package!r} is not "
                f"a subclass of {protocol.__module__}.{protocol.__qualname__}"
            )
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not name:
            raise PluginError(f"{kind[:-1].replace('_', ' ')} {cls.__qualname__} from package {package!r} has no `name`")
        taken = self.entries[kind].get(name)
        if taken is not None and taken.cls is not cls:
            raise PluginError(
                f"{kind[:-1].replace('_', ' ')} name {name!r} is registered twice: by package "
                f"{taken.package!r} ({taken.cls.__module__}.{taken.cls.__qualname__}) and by package "
                f"{package!r} ({cls.__module__}.{cls.__qualname__})"
            )
        self.entries[kind][name] = Registration(kind, name, cls, package, version)

    def get(self, kind: str, name: str) -> type:
        """The class of `kind` registered as `name` (a subclass of the kind's protocol class: `add` checked)."""
        try:
            return self.entries[kind][name].cls
        except KeyError:
            known = ", ".join(sorted(self.entries[kind])) or "none"
            raise PluginError(f"no {kind[:-1].replace('_', ' ')} named {name!r} is installed (installed: {known})") from None

    def trainer_source(self, name: str) -> type[TrainerSource]:
        return cast("type[TrainerSource]", self.get("trainer_sources", name))

    def engine_target(self, name: str) -> type[EngineTarget]:
        return cast("type[EngineTarget]", self.get("engine_targets", name))

    def transport(self, name: str) -> type[Transport]:
        return cast("type[Transport]", self.get("transports", name))

    def make_transport(self, transport: Transport | str, options: Mapping[str, Any] | None = None) -> Transport:
        """`transport` itself if it is an instance, else the registered transport of that
        name built with `options` (parsed into its `Options`: a misspelt one fails here,
        before anything binds)."""
        if not isinstance(transport, str):
            if options:
                raise OptionsError(
                    f"transport_options apply to a transport given by name; give "
                    f"{type(transport).__name__} its options when constructing it"
                )
            return transport
        return self.transport(transport)(options=options)

    def all(self) -> list[Registration]:
        return [reg for kind in KINDS for reg in self.entries[kind].values()]


@dataclass
class Plugins:
    """A plugin manager with p2psync's hook specs, and the package of each plugin it loaded."""

    manager: pluggy.PluginManager
    packages: dict[str, tuple[str, str]] = field(default_factory=dict)

    @classmethod
    def load(cls, autoload: bool | None = None) -> Plugins:
        """Load the `p2psync` entry points: all of them, or only p2psync's own when
        autoload is off (argument, or the P2PSYNC_DISABLE_PLUGIN_AUTOLOAD variable)."""
        if autoload is None:
            autoload = not os.environ.get(AUTOLOAD_ENV)
        manager = pluggy.PluginManager(hookspecs.PROJECT)
        manager.add_hookspecs(hookspecs)
        plugins = cls(manager)
        for ep in importlib.metadata.entry_points(group=hookspecs.PROJECT):
            package = ep.dist.metadata["name"] if ep.dist is not None else "unknown"
            if not autoload and package != "p2psync":
                continue
            if manager.is_blocked(ep.name):
                continue
            if manager.get_plugin(ep.name) is not None:
                taken = plugins.packages[ep.name][0]
                if taken == package:  # the same distribution found twice on sys.path
                    continue
                raise PluginError(
                    f"entry point {ep.name!r} of group {hookspecs.PROJECT!r} is declared by package "
                    f"{taken!r} and by package {package!r}"
                )
            try:
                module = ep.load()
            except Exception as exc:  # name the package whose plugin is broken
                raise PluginError(f"plugin {ep.name!r} of package {package!r} does not load: {exc!r}") from exc
            plugins.register(module, name=ep.name, package=package, version=ep.dist.version if ep.dist else "unknown")
        return plugins

    def register(self, plugin: object, *, name: str, package: str | None = None, version: str = "unknown") -> None:
        """Register a plugin object (a module or class with hook implementations)."""
        self.manager.register(plugin, name=name)
        self.packages[name] = (package or name, version)

    def registry(self) -> Registry:
        """Call every registration hook, attributing each class to its plugin's package."""
        registry = Registry()
        for kind in KINDS:
            caller = getattr(self.manager.hook, f"p2psync_register_{kind}")
            for impl in caller.get_hookimpls():
                package, version = self.packages.get(impl.plugin_name, (impl.plugin_name, "unknown"))

                def register(cls: Any, _kind: str = kind, _package: str = package, _version: str = version) -> None:
                    registry.add(_kind, cls, _package, _version)

                impl.function(register=register)
        return registry


_registry: Registry | None = None


def registry() -> Registry:
    """The process-wide registry, built on first use."""
    global _registry
    if _registry is None:
        _registry = Plugins.load().registry()
    return _registry
