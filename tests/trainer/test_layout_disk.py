"""Compiled layouts on disk (`layout_cache_dir`, p2psync/trainer/layout_disk.py): a trainer
process that starts again (here: this process with its memory of layouts dropped) reads its
layouts instead of compiling them, and its updates stay bit-exact; an entry that is corrupt,
truncated, another key's or another version's is compiled again and rewritten, with one
warning naming the file. The oracle is the toy engine's own loader (`assert_own_load`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from p2psync.trainer.layout_disk import LayoutDisk
from p2psync.trainer.layouts import LayoutCounts, forget_layouts
from p2psync.trainer.options import SessionOptions
from tests.helpers.doubles import DictSource
from tests.helpers.toy_engine import ToyTarget, hf_model, toy_session
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
