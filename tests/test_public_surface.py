"""The public surface: `p2psync` exports what users and plugin authors need, `import p2psync`
stays light, and the shipped example plugin needs nothing else."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import p2psync
import p2psync.conformance
from p2psync.core import errors

PLUGIN_PKG = Path(__file__).parent / "plugin_pkg"
#: What a user and a plugin author must find at `p2psync.<name>`.
NEEDED = {
    "Session", "SessionOptions", "DeltaOptions", "Rendezvous", "UpdateReport", "EngineReport",
    "P2PSyncError", "ConnectError", "UpdateError", "TrainerLost", "ControlError", "TransferError", "OptionsError",
    "ConcurrentCallError", "VersionError", "TrainerSource", "EngineTarget", "EngineControl", "Transport", "Peer",
    "WriteBatch", "Layout", "ParamGroup", "ParamSpec", "TargetTable", "TargetId", "Region", "hookimpl",
    "EngineEndpoint", "EngineHooks", "EndpointOptions",
}


def test_every_exported_name_resolves_and_the_needed_ones_are_exported():
    assert NEEDED <= set(p2psync.__all__)
    for name in p2psync.__all__:
        assert getattr(p2psync, name) is not None, name
    for name in p2psync.conformance.__all__:
        assert getattr(p2psync.conformance, name) is not None, name


def test_every_public_error_is_exported():
    public = {
        name for name, obj in vars(errors).items()
        if isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ == errors.__name__
        and not name.startswith("_")
    }
    assert public <= set(p2psync.__all__), sorted(public - set(p2psync.__all__))


def test_type_checkers_see_every_export_where_it_is_imported_from():
    """The `if TYPE_CHECKING:` imports of p2psync/__init__.py name exactly the lazy exports, each
    from the module `__getattr__` imports it from."""
    tree = ast.parse(Path(p2psync.__file__).read_text())
    (block,) = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    seen = {
        alias.name: "p2psync" + "." * (node.level > 0) + (node.module or "")
        for node in block.body if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert seen == p2psync._EXPORTS
    assert p2psync.__all__ == sorted({*p2psync._EXPORTS, "__version__"})


def test_importing_p2psync_imports_no_framework():
    code = (
        "import sys, p2psync, p2psync.conformance\n"
        "for name in p2psync.__all__: getattr(p2psync, name)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'torch', 'sglang', 'vllm', 'megatron', 'transformers', 'mooncake', 'nixl', 'verl'})\n"
        "print(heavy)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_the_example_plugin_imports_only_the_public_surface():
    for path in [PLUGIN_PKG / "p2psync_testplugin.py", *sorted((PLUGIN_PKG / "tests").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "p2psync":
                assert node.module in ("p2psync", "p2psync.conformance"), f"{path.name} imports {node.module}"
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.name} imports private names {private}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    assert alias.name.split(".")[0] != "p2psync" or alias.name in ("p2psync", "p2psync.conformance")


def test_session_keywords_are_typed_as_the_options_fields():
    """`Session(..., **changes)` is typed by `SessionChanges` (tests/typing/session_options.py shows
    mypy refusing a misspelt or mistyped option): its keys and types are `SessionOptions`' fields."""
    import dataclasses

    from p2psync.trainer.options import SessionChanges, SessionOptions

    fields = {f.name: f.type for f in dataclasses.fields(SessionOptions)}
    keywords = {name: getattr(kind, "__forward_arg__", kind) for name, kind in SessionChanges.__annotations__.items()}
    assert keywords == fields
