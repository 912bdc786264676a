"""Compiled layouts on disk (`layout_cache_dir`, p2psync/trainer/layout_disk.py): a trainer
process that starts again (here: this process with its memory of layouts dropped) reads its
layouts instead of compiling them, and its updates stay bit-exact; an entry that is corrupt,
truncated, another key's or another version's is compiled again and rewritten, with one
warning naming the file. An entry written well-formed under its right key but wrong (blocks
swapped, a block a row off, a region past its parameter, another adapter build's layout) is
refused by the check against the engine's own loader, removed and compiled again; entries of
another build (of p2psync or of the engine adapter) are never read. The oracle is the toy
engine's own loader (`assert_own_load`)."""

from __future__ import annotations

import json
import logging
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest

from p2psync.core.version import source_hash
from p2psync.trainer import layouts
from p2psync.trainer.layout_disk import LayoutDisk
from p2psync.trainer.layouts import LayoutCounts, adapter_build, forget_layouts
from p2psync.trainer.options import SessionOptions
from tests.helpers.doubles import DictSource
from tests.helpers.toy_engine import HIDDEN, ToyEngineModel, ToyRankModel, ToyTarget, hf_model, toy_session
from tests.layouts.test_add_an_engine import assert_own_load, state_of


@pytest.fixture
def built(monkeypatch):
    """The ranks whose layouts the toy target compiled; no layout in memory at first."""
    ranks: list[int] = []
    real = ToyTarget.layout
    monkeypatch.setattr(ToyTarget, "layout", lambda self, table, specs: ranks.append(table.rank) or real(self, table, specs))
    forget_layouts()
    yield ranks
    forget_layouts()


def connect_and_update(cache: Path, seed: int = 1, tp: int = 2) -> LayoutCounts:
    """A toy session of `tp` ranks with its layouts cached in `cache`: where they came from,
    after an update whose bytes are checked against the engine's own loader."""
    trainer = hf_model(seed)
    with toy_session(DictSource(state_of(trainer)), tp=tp, layout_cache_dir=str(cache)) as (session, engines):
        counts = session.stats().layouts
        assert session.update("v1").ok
    assert_own_load(engines, state_of(trainer), counts)
    return counts


def entries(cache: Path) -> list[Path]:
    return sorted((cache / "layouts").glob("*.layout"))


def test_a_fresh_process_reads_its_layouts_from_the_cache_dir(tmp_path, built):
    assert connect_and_update(tmp_path) == LayoutCounts(compiled=2)
    assert len(entries(tmp_path)) == 2 and not list((tmp_path / "layouts").glob(".*")), "no temporary file is left"
    forget_layouts()  # what a fresh process has in memory
    assert connect_and_update(tmp_path, seed=2) == LayoutCounts(disk=2)
    assert sorted(built) == [0, 1], "read from disk, not compiled again"


def _flip(data: bytes, other: bytes) -> bytes:
    return data[:-20] + bytes([data[-20] ^ 0xFF]) + data[-19:]


def _truncate(data: bytes, other: bytes) -> bytes:
    return data[:-50]


def _other_key(data: bytes, other: bytes) -> bytes:
    return other  # another rank's entry, renamed into place


def _other_version(data: bytes, other: bytes) -> bytes:
    magic, header, payload = data.split(b"\n", 2)
    return b"\n".join([magic, json.dumps({**json.loads(header), "p2psync": "0.0.1"}).encode(), payload])


POISONS = [
    (_flip, "does not match its SHA-256"),
    (_truncate, "truncated"),
    (_other_key, "holds the layout of another key"),
    (_other_version, "by p2psync '0.0.1'"),
]


def test_poisoned_entries_are_compiled_again_and_rewritten(tmp_path, built, caplog):
    """Four ranks' entries, each poisoned another way: each is compiled again (and the update
    still equals the engine's own load), warned about once by name, and written again."""
    connect_and_update(tmp_path, tp=4)
    kept = {p: p.read_bytes() for p in entries(tmp_path)}
    paths = list(kept)
    for i, (path, (poison, _)) in enumerate(zip(paths, POISONS)):
        path.write_bytes(poison(kept[path], kept[paths[i - 1]]))
    forget_layouts()
    built.clear()
    with caplog.at_level(logging.WARNING, logger="p2psync.trainer.layout_disk"):
        assert connect_and_update(tmp_path, seed=2, tp=4) == LayoutCounts(compiled=4)
    assert sorted(built) == [0, 1, 2, 3]
    warned = [r.getMessage() for r in caplog.records if r.name == "p2psync.trainer.layout_disk"]
    assert len(warned) == 4, warned
    for path, (_, why) in zip(paths, POISONS):
        (message,) = [m for m in warned if str(path) in m]
        assert why in message, message
    assert {p: p.read_bytes() for p in entries(tmp_path)} == kept, "the entries are written again as they were"


def test_the_cache_dir_defaults_to_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("P2PSYNC_CACHE_DIR", str(tmp_path))
    assert SessionOptions().layout_cache_dir == str(tmp_path)
    assert SessionOptions(layout_cache_dir=None).layout_cache_dir is None
    monkeypatch.delenv("P2PSYNC_CACHE_DIR")
    assert SessionOptions().layout_cache_dir is None


def test_an_unwritable_cache_dir_is_a_warning(tmp_path, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("")
    with caplog.at_level(logging.WARNING, logger="p2psync.trainer.layout_disk"):
        LayoutDisk(str(blocked)).store("key", b"payload")
    assert "could not be written" in caplog.text and str(blocked) in caplog.text


def _rewrite(path: Path, change: Callable[[dict], None]) -> None:
    """Entry `path` written again as LayoutDisk writes it (magic, format, its own key, the
    payload's size and SHA-256), its layout changed by `change`."""
    _, header, payload = path.read_bytes().split(b"\n", 2)
    doc = json.loads(zlib.decompress(payload))
    change(doc["layout"])
    LayoutDisk(str(path.parent.parent)).store(json.loads(header)["key"], zlib.compress(json.dumps(doc).encode()))


def _param(layout: dict, name: str) -> list:
    """The stored entry of parameter `name`: slot name, offset, shape, dtype, bytes, regions, blocks."""
    return next(p for g in layout["groups"] for p in g[3] if layout["names"][p[0]] == name)


def _swap_blocks(layout: dict) -> None:
    """Layer 0's q rows written where its k rows go, and k's where q's go."""
    q, k = _param(layout, "layers.0.qkv")[6][:2]
    q[2], k[2] = k[2], q[2]


def _shift_a_row(layout: dict) -> None:
    """Layer 0's k read a row off (the next row on rank 0, the one before on rank 1: inside k)."""
    k = _param(layout, "layers.0.qkv")[6][1]
    k[4] += HIDDEN if k[4] < HIDDEN else -HIDDEN


def _out_of_bounds(layout: dict) -> None:
    """Layer 0's norm written 4 bytes further on: its last 4 bytes past the parameter's end."""
    regions = _param(layout, "layers.0.norm")[5]  # name, parameter offset, buffer offset, bytes
    regions[1] += 4
    regions[2] += 4


WRONG = [
    (_swap_blocks, "its copies do not write what the loader writes"),
    (_shift_a_row, "its copies do not write what the loader writes"),
    (_out_of_bounds, "outside its 64 bytes"),
]


@pytest.mark.parametrize("wrong, why", WRONG, ids=["swapped-blocks", "shifted-row", "out-of-bounds"])
def test_wrong_entries_are_checked_removed_and_compiled_again(tmp_path, built, caplog, monkeypatch, wrong, why):
    """Both ranks' entries well-formed under their right keys, their layouts wrong: each is
    refused by the check against the engine's own loader, removed with a warning naming it,
    and compiled again; the update, checked, holds the engine's own bytes."""
    connect_and_update(tmp_path)
    kept = {p: p.read_bytes() for p in entries(tmp_path)}
    for path in kept:
        _rewrite(path, wrong)
    removed: list[Path] = []
    unlink = Path.unlink
    monkeypatch.setattr(Path, "unlink", lambda self, *a, **k: removed.append(self) or unlink(self, *a, **k))
    forget_layouts()
    built.clear()
    with caplog.at_level(logging.WARNING, logger="p2psync.trainer.layout_disk"):
        assert connect_and_update(tmp_path, seed=2) == LayoutCounts(compiled=2)
    assert sorted(built) == [0, 1] and sorted(removed) == sorted(kept)
    warned = [r.getMessage() for r in caplog.records if r.name == "p2psync.trainer.layout_disk"]
    assert len(warned) == 2, warned
    for path in kept:
        (message,) = [m for m in warned if str(path) in m]
        assert why in message and "removing it" in message, message
    assert {p: p.read_bytes() for p in entries(tmp_path)} == kept, "compiled again and written as they were"


@pytest.mark.parametrize("build", ["adapter_build", "layout_build"])
def test_entries_of_another_build_are_never_read(tmp_path, built, monkeypatch, build):
    """The key names the engine adapter's build (a hash of its package's sources) and p2psync's
    (its version, the same at every commit, and a hash of its layout sources): entries another
    build wrote are not read, this build's still are."""
    with monkeypatch.context() as other:
        other.setattr(layouts, build, lambda *_: "another build")
        assert connect_and_update(tmp_path) == LayoutCounts(compiled=2)
    forget_layouts()
    assert connect_and_update(tmp_path, seed=2) == LayoutCounts(compiled=2)
    assert len(entries(tmp_path)) == 4
    forget_layouts()
    assert connect_and_update(tmp_path, seed=3) == LayoutCounts(disk=2)


class _OtherBuild(ToyEngineModel):
    """Another build of the toy engine's model: its loader puts q's rows where k's go, and k's where q's."""

    def load_weights(self, items):
        other = {"q": "k", "k": "q"}
        super().load_weights([(".".join(other.get(part, part) for part in name.split(".")), w) for name, w in items])


def _other_rank_model(self, table):
    return ToyRankModel(table.layout_key["tp"], table.rank, model=_OtherBuild)


def test_an_entry_another_adapter_build_left_under_the_same_key_is_refused(tmp_path, built, monkeypatch, caplog):
    """Where the key cannot tell two builds of the engine adapter apart, the entries the other
    build compiled (q and k swapped) are refused by the check against this build's own loader,
    removed and compiled again: the update holds the engine's own bytes."""
    monkeypatch.setattr(layouts, "adapter_build", lambda cls: "one build")
    with monkeypatch.context() as other:
        other.setattr(ToyTarget, "rank_model", _other_rank_model)
        with toy_session(DictSource(state_of(hf_model(1))), layout_cache_dir=str(tmp_path)) as (session, _):
            assert session.stats().layouts == LayoutCounts(compiled=2)
    written = entries(tmp_path)
    forget_layouts()
    with caplog.at_level(logging.WARNING, logger="p2psync.trainer.layout_disk"):
        assert connect_and_update(tmp_path, seed=2) == LayoutCounts(compiled=2)
    warned = [r.getMessage() for r in caplog.records if r.name == "p2psync.trainer.layout_disk"]
    assert len(warned) == 2 and all(any(str(p) in m for m in warned) for p in written), warned
    assert all("its copies do not write what the loader writes" in m for m in warned), warned


def test_a_refused_entry_is_removed(tmp_path, caplog):
    disk = LayoutDisk(str(tmp_path))
    disk.store("key", b"payload")

    def refuse(payload: bytes) -> None:
        raise ValueError("not this build's layout")

    with caplog.at_level(logging.WARNING, logger="p2psync.trainer.layout_disk"):
        assert disk.load("key", refuse) is None
    assert not disk.has("key") and str(disk.path("key")) in caplog.text and "not this build's layout" in caplog.text


def test_an_adapter_build_is_the_hash_of_its_package_sources(tmp_path):
    assert adapter_build(ToyTarget) == source_hash(str(Path(__file__).parents[1] / "helpers"))
    for name, text in (("a", "x = 1\n"), ("b", "x = 1\n"), ("c", "x = 2\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "m.py").write_text(text)
    a, b, c = (source_hash(str(tmp_path / name)) for name in "abc")
    assert a == b != c
    shutil.rmtree(tmp_path / "a")
    assert source_hash(str(tmp_path / "a")) == a, "read once per process"


@pytest.mark.parametrize("where", ["compiled", "disk"])
def test_connect_tells_its_progress_in_layouts(tmp_path, built, where):
    """`connect(progress=)` counts layouts, one per engine rank unit, as each is at hand."""
    if where == "disk":
        connect_and_update(tmp_path, tp=4)
        forget_layouts()
    told: list[tuple[int, int]] = []
    cache = str(tmp_path) if where == "disk" else None
    with toy_session(DictSource(state_of(hf_model(1))), tp=4, layout_cache_dir=cache) as (session, _):
        forget_layouts()
        session.connect(["toy-0"], progress=lambda done, total: told.append((done, total)))
        counts = session.stats().layouts
    assert told[-1] == (4, 4) and {total for _, total in told} == {4}, told
    assert [done for done, _ in told] == sorted(done for done, _ in told), told
    assert counts.compiled + counts.disk + counts.memory == 4
    assert (counts.disk if where == "disk" else counts.compiled) == 4, counts
