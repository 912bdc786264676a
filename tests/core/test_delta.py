"""Delta encoding, the engine's patch apply and the sender's baselines, without engines
(tox env py). The oracle is the new bytes themselves: a patch applied to the old
bytes must give them back exactly, at every element size and changed fraction."""

from __future__ import annotations

import pytest
import torch

from p2psync.trainer.baseline import BaselineStore
from p2psync.core.delta import (
    PatchRecord,
    _diff_device,
    _diff_host,
    cheapest,
    diff,
    elements,
    meta_bytes,
    pack_bits,
    piece,
    record_bytes,
    unpack_bits,
)
from p2psync.trainer.options import DeltaOptions, parse_delta
from p2psync.core.errors import OptionsError
from p2psync.core.layout import ParamGroup
from p2psync.engine.patch import PatchArea, _scatter_device, _scatter_host

DTYPES = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


def changed_copy(old: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """`old` with about `fraction` of its elements replaced by other random bits."""
    generator = torch.Generator().manual_seed(seed)
    new = old.clone()
    raw = new.view(-1).view(torch.uint8).view(old.numel(), -1)
    pick = torch.rand(old.numel(), generator=generator) < fraction
    raw[pick] ^= torch.randint(1, 256, (int(pick.sum()), raw.shape[1]), dtype=torch.uint8, generator=generator)
    return new


def stage(change, area: torch.Tensor, param: str, param_offset: int, elem: int, at: int = 0) -> PatchRecord:
    """Lay a sparse change out in `area` as the sender stages it."""
    meta_at, values_at = at, at + piece(change.meta.numel())
    area[meta_at : meta_at + change.meta.numel()] = change.meta
    area[values_at : values_at + change.values.numel()] = change.values
    return PatchRecord(param, param_offset, elem, change.count, change.changed, change.kind, meta_at, values_at)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("elem", [1, 2, 4, 8])
@pytest.mark.parametrize("fraction", [0.001, 0.02, 0.2, 0.9])
def test_patch_applied_to_old_bytes_gives_the_new_bytes(elem, fraction):
    old = torch.randn(4099).to(DTYPES[elem])
    new = changed_copy(old, fraction, seed=elem)
    change = diff(as_bytes(new), as_bytes(old), elem)
    differ = (as_bytes(new).view(-1, elem) != as_bytes(old).view(-1, elem)).any(1)
    assert change is not None and change.changed == int(differ.sum())
    held = old.clone()  # what the engine holds
    if change.kind == "dense":
        assert fraction >= 0.2  # dense only where many changed
        return
    area = PatchArea(1 << 20, torch.device("cpu"))
    record = stage(change, area.tensor, "w", 0, elem)
    assert area.apply({"w": held}, [record.to_wire()]) == change.changed
    assert torch.equal(as_bytes(held), as_bytes(new))


@pytest.mark.parametrize("elem", [1, 2, 8])
@pytest.mark.parametrize("fraction", [0.001, 0.2])
def test_the_device_path_encodes_as_the_host_path(elem, fraction):
    """`_diff_device` (the GPU's torch ops) run on CPU tensors gives the host path's bytes."""
    old = torch.randn(3001).to(DTYPES[elem])
    new = changed_copy(old, fraction, seed=7)
    a, b = (elements(as_bytes(t), elem) for t in (new, old))
    host, device = _diff_host(a, b, elem), _diff_device(a, b, elem)
    assert (host.kind, host.count, host.changed) == (device.kind, device.count, device.changed)
    assert torch.equal(host.meta, device.meta) and torch.equal(host.values, device.values)


@pytest.mark.parametrize("fraction", [0.002, 0.2])
def test_the_device_scatter_patches_as_the_host_scatter(fraction):
    """`_scatter_device` (the GPU's kernels) run on CPU tensors leaves the host path's bytes."""
    old = torch.randn(5003).to(torch.bfloat16)
    new = changed_copy(old, fraction, seed=11)
    change = diff(as_bytes(new), as_bytes(old), 2)
    area = torch.zeros(1 << 16, dtype=torch.uint8)
    record = stage(change, area, "w", 0, 2)
    meta = area[record.meta_offset : record.meta_offset + meta_bytes(record.kind, record.count, record.changed)]
    values = elements(area[record.values_offset : record.values_offset + 2 * record.changed], 2)
    on_device, on_host = (elements(as_bytes(old.clone()), 2) for _ in range(2))
    _scatter_device(on_device, record, meta, values)
    _scatter_host(on_host.numpy(), record, meta.numpy(), values.numpy())
    assert torch.equal(on_device, on_host) and torch.equal(on_host, elements(as_bytes(new), 2))


def test_nan_and_signed_zero_compare_as_bits():
    old = torch.tensor([0.0, float("nan"), 1.0, 2.0] * 64, dtype=torch.bfloat16)
    new = old.clone()
    new[0] = -0.0  # equal as floats, other bytes
    new[1] = float("nan")  # unequal as floats, same bytes
    change = diff(as_bytes(new), as_bytes(old), 2)
    assert change is not None and change.changed == 1


def test_unchanged_bytes_send_nothing():
    old = torch.randn(100)
    assert diff(as_bytes(old.clone()), as_bytes(old), 4) is None


def test_the_cheapest_form_is_chosen_by_size():
    # 2-byte elements: bitmap costs n/8 + 2k, index 6k, dense 2n
    assert cheapest(10_000, 10, 2) == "index"
    assert cheapest(10_000, 2_000, 2) == "bitmap"
    assert cheapest(10_000, 9_500, 2) == "dense"  # the bitmap alone would add 1250 bytes
    assert cheapest(8, 1, 2) == "dense"  # a record's overhead outweighs 16 bytes
    for count, changed in [(10_000, 10), (10_000, 2_000), (10_000, 300)]:
        kind = cheapest(count, changed, 2)
        others = [record_bytes(k, count, changed, 2) for k in ("bitmap", "index")]
        assert record_bytes(kind, count, changed, 2) == min(others)


def test_bits_round_trip_least_significant_first():
    mask = torch.tensor([True, False, False, True] + [False] * 4 + [True])
    bits = pack_bits(mask)
    assert bits.tolist() == [0b1001, 0b1]
    assert torch.equal(unpack_bits(bits, mask.numel()), mask)


def test_record_wire_round_trip_and_malformed_rows():
    record = PatchRecord("w", 8, 2, 100, 3, "index", 0, 16)
    assert PatchRecord.from_wire(record.to_wire()) == record
    for row in [["w", 8, 2, 100, 3, "rle", 0, 16], ["w", -8, 2, 100, 3, "index", 0, 16], ["w", 8, 2], "w"]:
        with pytest.raises(ValueError):
            PatchRecord.from_wire(row)


def bad_patches(area: torch.Tensor, held: torch.Tensor, new: torch.Tensor):
    """Records that must be refused, each with a fragment of the reason."""
    change = diff(as_bytes(new), as_bytes(held), 2)
    assert change is not None and change.kind == "index"
    good = stage(change, area, "w", 0, 2)
    yield [good.to_wire()[:5] + ["bitmap"] + good.to_wire()[6:]], "disagree"
    yield [PatchRecord("nope", 0, 2, 4, 1, "index", 0, 8).to_wire()], "does not hold"
    yield [PatchRecord("w", 2000, 2, 100, 1, "index", 0, 8).to_wire()], "beyond"
    yield [PatchRecord("w", 0, 2, 100, 1, "index", 0, 1 << 30).to_wire()], "patch-area bytes"
    yield [PatchRecord("w", 1, 2, 4, 1, "index", 0, 8).to_wire()], "aligned"
    out_of_range = stage(change, area, "w", 0, 2, at=4096)
    area[4096:4100] = torch.tensor([255, 255, 0, 0], dtype=torch.uint8)  # index 65535 of 1000 elements
    yield [good.to_wire(), out_of_range.to_wire()], "disagree"


def test_bad_patches_are_refused_before_any_byte_changes():
    held = torch.randn(1000).to(torch.bfloat16)
    new = changed_copy(held, 0.01, seed=3)
    area = PatchArea(1 << 16, torch.device("cpu"))
    for rows, reason in bad_patches(area.tensor, held, new):
        before = held.clone()
        with pytest.raises(ValueError, match=reason):
            area.apply({"w": held}, rows)
        assert torch.equal(as_bytes(held), as_bytes(before)), reason


def test_baselines_keep_their_bytes_per_group_and_respect_the_budget():
    g1, g2, g3 = ParamGroup(("a",), ("a",), 100), ParamGroup(("b",), ("b",), 30), ParamGroup(("c",), ("c",), 500)
    store = BaselineStore(budget=300)
    store.configure({"u1": [g1, g2], "u2": [g3]})
    store.start_update()
    assert store.slot("u2", g3) is None  # 512 aligned bytes do not fit beside u1's 192
    assert store.held_bytes == 192
    store.slot("u1", g2).fill_(7)
    store.slot("u1", g1).fill_(1)
    store.seal(1)
    assert (store.update_of("u1"), store.update_of("u2")) == (1, None)
    assert store.slot("u1", g2).tolist() == [7] * 30

    store.start_update()
    assert store.update_of("u1") is None  # being overwritten
    store.break_unit("u1")
    store.seal(2)
    assert store.update_of("u1") is None  # half new: no target may take a delta against it

    store.configure({"u1": [g1, g2]})
    store.start_update()
    store.seal(3)
    assert store.update_of("u1") == 3 and store.slot("u1", g2).tolist() == [7] * 30  # kept
    store.configure({"u1": [g2, g1]})  # another order: other slots, a new baseline
    assert store.update_of("u1") is None and store.held_bytes == 0


def test_delta_options_are_typed():
    assert parse_delta(False) is None and parse_delta(True) == DeltaOptions()
    assert parse_delta({"full_every": 4}) == DeltaOptions(full_every=4)
    with pytest.raises(OptionsError, match="full_every"):
        parse_delta({"full_evry": 4})
    with pytest.raises(OptionsError, match="0 or more"):
        parse_delta({"full_every": -1})
