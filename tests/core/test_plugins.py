"""Plugin loading: built-ins and third-party packages alike, through the `p2psync` entry points."""

from __future__ import annotations

import ctypes
import importlib
import importlib.metadata
import shutil
import sys
import tomllib
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from p2psync.core.engine import EngineTarget
from p2psync.core.errors import PluginError, TransferError
from p2psync.core.hookspecs import hookimpl
from p2psync.core.plugins import AUTOLOAD_ENV, Plugins, Registration
from p2psync.core.source import TrainerSource
from p2psync.core.transport import Transport, WriteBatch
from p2psync.core.types import ParamSpec, TargetParam, TargetTable

PLUGIN_PKG = Path(__file__).parents[1] / "plugin_pkg"
MODULE = "p2psync_testplugin"
#: Registrations p2psync itself must provide (it may provide more).
BUILTINS = {("trainer_sources", "fsdp2"), ("engine_targets", "torch"), ("transports", "mooncake")}


def own_entry_points() -> set[str]:
    """Names of the `p2psync` entry points that the installed p2psync declares."""
    dist = importlib.metadata.distribution("p2psync")
    return {ep.name for ep in dist.entry_points if ep.group == "p2psync"}


@pytest.fixture(autouse=True)
def _no_autoload_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(AUTOLOAD_ENV, raising=False)


def install_dist(root: Path, entry_points: dict[str, str], *, name: str, version: str) -> None:
    """What pip leaves in site-packages for a wheel: the module and its dist-info."""
    shutil.copy(PLUGIN_PKG / f"{MODULE}.py", root / f"{MODULE}.py")
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[p2psync]\n{lines}")


@pytest.fixture
def on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on sys.path, as site-packages is; the plugin module is forgotten afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))  # also invalidates the import caches
    sys.modules.pop(MODULE, None)
    yield tmp_path
    sys.modules.pop(MODULE, None)
    importlib.invalidate_caches()


@pytest.fixture
def testplugin(on_path: Path) -> dict[str, Any]:
    """The package of tests/plugin_pkg, installed as its pyproject.toml declares."""
    project = tomllib.loads((PLUGIN_PKG / "pyproject.toml").read_text())["project"]
    install_dist(on_path, project["entry-points"]["p2psync"], name=project["name"], version=project["version"])
    return project


def plugin_registering(kind: str, *classes: type) -> types.SimpleNamespace:
    """A plugin object whose hook for `kind` registers `classes`."""
    hook = f"p2psync_register_{kind}"

    def impl(register: Callable[[type], None]) -> None:
        for cls in classes:
            register(cls)

    impl.__name__ = hook
    return types.SimpleNamespace(**{hook: hookimpl(impl)})


class NullTransport(Transport):
    name = "null"

    def expose(self, tensors: Any) -> dict[str, Any]:
        return {}

    def register_buffer(self, buffer: Any) -> None:
        pass

    def unregister_buffer(self, buffer: Any) -> None:
        pass

    def open(self, table: TargetTable) -> Any:
        raise TransferError("nowhere to write")

    def close(self) -> None:
        pass


def with_name(name: Any, base: type = NullTransport) -> type:
    return type("Renamed", (base,), {"name": name})


# -- built-ins -------------------------------------------------------------------------------


def test_builtins_come_from_package_p2psync() -> None:
    from p2psync.adapters.fsdp2.source import FSDP2Source
    from p2psync.adapters.torch.target import TorchEngineTarget
    from p2psync.transports.mooncake.transport import MooncakeTransport

    version = importlib.metadata.version("p2psync")
    registry = Plugins.load().registry()
    for kind, name in BUILTINS:
        reg = registry.entries[kind].get(name)
        assert reg is not None, f"built-in {kind} {name!r} not registered"
        assert (reg.kind, reg.name, reg.package, reg.version) == (kind, name, "p2psync", version)
    assert registry.trainer_source("fsdp2") is FSDP2Source
    assert registry.engine_target("torch") is TorchEngineTarget
    assert registry.transport("mooncake") is MooncakeTransport


def test_unknown_name_lists_what_is_installed() -> None:
    registry = Plugins.load(autoload=False).registry()
    with pytest.raises(PluginError, match=r"no transport named 'carrier-pigeon' is installed \(installed: .*mooncake"):
        registry.transport("carrier-pigeon")


# -- names -----------------------------------------------------------------------------------


def test_duplicate_name_raises_naming_both_packages() -> None:
    plugins = Plugins.load(autoload=False)
    plugins.register(plugin_registering("transports", with_name("mooncake")), name="evil", package="evil-pkg")
    with pytest.raises(PluginError) as info:
        plugins.registry()
    message = str(info.value)
    assert "transport name 'mooncake' is registered twice" in message
    assert "'p2psync'" in message and "MooncakeTransport" in message
    assert "'evil-pkg'" in message and "Renamed" in message


def test_duplicate_name_between_two_third_party_packages() -> None:
    plugins = Plugins(Plugins.load(autoload=False).manager)
    plugins.register(plugin_registering("transports", with_name("shared")), name="one", package="pkg-one")
    plugins.register(plugin_registering("transports", with_name("shared")), name="two", package="pkg-two")
    with pytest.raises(PluginError, match="'pkg-one'.*'pkg-two'|'pkg-two'.*'pkg-one'"):
        plugins.registry()


def test_same_class_registered_twice_is_not_a_duplicate() -> None:
    plugins = Plugins.load(autoload=False)
    plugins.register(plugin_registering("transports", NullTransport), name="one", package="pkg-one")
    plugins.register(plugin_registering("transports", NullTransport), name="two", package="pkg-two")
    assert plugins.registry().transport("null") is NullTransport


@pytest.mark.parametrize("name", [None, "", 7], ids=["missing", "empty", "not-a-string"])
def test_class_without_a_name_raises(name: Any) -> None:
    cls = NullTransport if name is None else with_name(name)
    if name is None:
        # A subclass that only inherits the annotation `name: ClassVar[str]`.
        cls = type("Nameless", (Transport,), dict(vars(NullTransport)))
        del cls.name
    plugins = Plugins.load(autoload=False)
    plugins.register(plugin_registering("transports", cls), name="sloppy", package="sloppy-pkg", version="1.0")
    with pytest.raises(PluginError, match=r"transport .* from package 'sloppy-pkg' has no `name`"):
        plugins.registry()


@pytest.mark.parametrize(
    ("kind", "base", "label"),
    [("trainer_sources", TrainerSource, "trainer source"), ("engine_targets", EngineTarget, "engine target")],
)
def test_nameless_error_names_the_kind(kind: str, base: type, label: str) -> None:
    plugins = Plugins.load(autoload=False)
    plugins.register(plugin_registering(kind, type("Anon", (base,), {})), name="x", package="x-pkg")
    with pytest.raises(PluginError, match=f"^{label} Anon from package 'x-pkg' has no `name`"):
        plugins.registry()


@pytest.mark.parametrize(
    ("kind", "wrong", "protocol"),
    [
        ("transports", TrainerSource, "p2psync.core.transport.Transport"),
        ("engine_targets", Transport, "p2psync.core.engine.EngineTarget"),
        ("trainer_sources", EngineTarget, "p2psync.core.source.TrainerSource"),
    ],
)
def test_a_class_that_is_not_its_kinds_protocol_is_refused_at_registration(kind: str, wrong: type, protocol: str) -> None:
    impostor = type("Impostor", (wrong,), {"name": "impostor"})
    plugins = Plugins.load(autoload=False)
    plugins.register(plugin_registering(kind, impostor), name="x", package="x-pkg")
    with pytest.raises(PluginError, match=f"'Impostor' from package 'x-pkg' is not a subclass of {protocol}"):
        plugins.registry()


def test_dependency_status() -> None:
    ok = Registration("transports", "a", type("A", (), {"requires": ("json", "ctypes")}), "pkg", "1")
    assert ok.dependency_status() == (True, "")
    missing = Registration("transports", "b", type("B", (), {"requires": ("json", "p2psync_no_such_module")}), "p", "1")
    usable, why = missing.dependency_status()
    assert not usable
    assert why.startswith("p2psync_no_such_module: ModuleNotFoundError")


# -- autoload --------------------------------------------------------------------------------


def test_autoload_off_loads_only_p2psync(testplugin: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(AUTOLOAD_ENV, "1")
    plugins = Plugins.load()
    assert {package for package, _ in plugins.packages.values()} == {"p2psync"}
    assert set(plugins.packages) == own_entry_points()
    registry = plugins.registry()
    assert {r.package for r in registry.all()} == {"p2psync"}
    assert BUILTINS <= {(r.kind, r.name) for r in registry.all()}
    assert MODULE not in sys.modules  # not even imported


def test_autoload_argument_overrides_the_variable(testplugin: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(AUTOLOAD_ENV, "1")
    assert "testplugin" in Plugins.load(autoload=True).packages
    monkeypatch.delenv(AUTOLOAD_ENV)
    assert "testplugin" not in Plugins.load(autoload=False).packages


# -- a third-party package -------------------------------------------------------------------


def test_third_party_plugin_is_loaded_from_its_entry_point(testplugin: dict[str, Any]) -> None:
    assert testplugin["name"] == "p2psync-testplugin" and testplugin["version"] == "0.1"
    plugins = Plugins.load()
    assert plugins.packages["testplugin"] == ("p2psync-testplugin", "0.1")
    registry = plugins.registry()

    module = sys.modules[MODULE]
    assert Path(module.__file__).parent == Path(sys.path[0])  # the installed copy, not the source tree
    mine = {(r.kind, r.name): r for r in registry.all() if r.package == "p2psync-testplugin"}
    assert set(mine) == {
        ("trainer_sources", "testplugin-dict"),
        ("engine_targets", "testplugin-copy"),
        ("transports", "testplugin-loopback"),
    }
    assert all(r.version == "0.1" for r in mine.values())
    assert registry.trainer_source("testplugin-dict") is module.DictSource
    assert issubclass(registry.trainer_source("testplugin-dict"), TrainerSource)
    assert issubclass(registry.engine_target("testplugin-copy"), EngineTarget)
    assert issubclass(registry.transport("testplugin-loopback"), Transport)
    # The built-ins are still there, still p2psync's.
    assert BUILTINS <= {(r.kind, r.name) for r in registry.all() if r.package == "p2psync"}


def test_third_party_classes_work(testplugin: dict[str, Any]) -> None:
    """The example plugin's classes are real: its transport moves bytes into what its
    engine target's layout produced."""
    import torch

    registry = Plugins.load().registry()
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    source = registry.trainer_source("testplugin-dict")({"w": weight})
    assert source.param_specs() == [ParamSpec("w", (3, 4), "float32")]

    engine_memory = torch.zeros(3, 4, dtype=torch.bfloat16)
    transport = registry.transport("testplugin-loopback")()
    info = transport.expose([engine_memory])
    param = TargetParam("w", (3, 4), "bfloat16", engine_memory.data_ptr(), 24)
    table = TargetTable("engine-a", 0, 1, "testplugin-copy", {}, "testplugin-loopback", info, "", (param,))
    layout = registry.engine_target("testplugin-copy")().layout(table, {s.name: s for s in source.param_specs()})
    (group,) = layout.groups()
    buffer = torch.zeros(64, dtype=torch.uint8)
    transport.register_buffer(buffer)
    regions = layout.fill(group, source.gather(["w"]), buffer)
    batch = WriteBatch()
    for r in regions:
        batch.add(buffer.data_ptr() + r.buffer_offset, engine_memory.data_ptr() + r.param_offset, r.nbytes)
    transport.open(table).write(batch, timeout=1.0)
    assert torch.equal(engine_memory, weight.to(torch.bfloat16))
    assert ctypes.string_at(engine_memory.data_ptr(), 24) == bytes(buffer[:24].tolist())


def test_plugin_package_declares_what_the_module_provides() -> None:
    """tests/plugin_pkg stays installable: the entry point names its module, and
    setuptools is told to ship it."""
    config = tomllib.loads((PLUGIN_PKG / "pyproject.toml").read_text())
    assert config["project"]["entry-points"]["p2psync"] == {"testplugin": MODULE}
    assert config["tool"]["setuptools"]["py-modules"] == [MODULE]
    assert (PLUGIN_PKG / f"{MODULE}.py").is_file()


def test_entry_point_name_taken_by_another_package_is_not_dropped_silently(on_path: Path) -> None:
    install_dist(on_path, {"torch": MODULE}, name="p2psync-torchx", version="1.0")
    try:
        registry = Plugins.load().registry()
    except PluginError as exc:  # refusing is fine, as long as it names both packages
        assert "p2psync-torchx" in str(exc) and "p2psync" in str(exc)
        return
    # Either way round, neither package's classes may go missing.
    packages = {r.package for r in registry.all()}
    assert {"p2psync", "p2psync-torchx"} <= packages
    assert BUILTINS <= {(r.kind, r.name) for r in registry.all() if r.package == "p2psync"}
