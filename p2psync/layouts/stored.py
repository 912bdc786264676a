"""Compiled layouts as bytes: what a layout cache on disk keeps and trainer ranks exchange.

A compiled `EngineLayout` is plain data (its groups, slots, regions and copy blocks), so it
is kept as that data: JSON (every name once, in a table that the rest points into) under
zlib. Never pickle: a cache directory shared between ranks and jobs must hold nothing that
runs code when read. The rank model is not kept; a restored layout whose parameters need
the engine's loader at every update (the replica, per-parameter fallbacks) rebuilds it
from its table through the engine target (`RankModelTarget.rank_model`) when it first
fills one of them. A `QuantizedLayout` is its quantizer, dtype and quantized tensors
around the inner layout. Other layouts (the torch engine's identity) are not kept: they
cost less to build than to read.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..core.layout import Layout, ParamGroup
from ..core.types import Region, TargetTable
from . import quantizers
from .copymap import Block
from .layout import EngineLayout, _Group, _Param, _Slot
from .quantized import QuantizedLayout
from .rank_model import RankModel

#: The format of the data below; bytes of another format are refused.
FORMAT = 2


class StoredLayoutError(ValueError):
    """Bytes that are not a layout of this FORMAT."""


def encode(layout: Layout) -> bytes | None:
    """`layout` as bytes, or None for a kind of layout that is not kept."""
    if isinstance(layout, QuantizedLayout):
        data: dict[str, Any] = {
            "kind": "quantized",
            "quantizer": [layout.quantizer.name, layout.quantizer.block],
            "dtype": _dtype_name(layout.dtype),
            "quantized": sorted(layout.quantized),
            "inner": _engine_data(layout.inner),
        }
    elif isinstance(layout, EngineLayout):
        data = {"kind": "engine", **_engine_data(layout)}
    else:
        return None
    text = json.dumps({"format": FORMAT, "layout": data}, separators=(",", ":"))
    return zlib.compress(text.encode(), 1)


def decode(data: bytes, table: TargetTable, rank_model: Callable[[], RankModel]) -> Layout:
    """The layout `encode` gave `data` for `table`'s unit; `rank_model` builds that rank's model
    (called only if, and when, a parameter the engine's loader produces is filled). Raises
    StoredLayoutError for anything else."""
    try:
        doc = json.loads(zlib.decompress(data))
        if doc["format"] != FORMAT:
            raise StoredLayoutError(f"format {doc['format']!r}, not {FORMAT}")
        layout = doc["layout"]
        if layout["kind"] == "engine":
            return _engine_layout(layout, table, rank_model)
        if layout["kind"] == "quantized":
            name, block = layout["quantizer"]
            return QuantizedLayout.restored(
                table, _engine_layout(layout["inner"], table, rank_model),
                quantizers.get(_text(name), None if block is None else [_int(b) for b in block]),
                _dtype(layout["dtype"]), frozenset(_text(n) for n in layout["quantized"]),
            )
        raise StoredLayoutError(f"unknown kind of layout {layout['kind']!r}")
    except StoredLayoutError:
        raise
    except (zlib.error, ValueError, KeyError, TypeError, IndexError, AttributeError, quantizers.QuantizerError) as exc:
        raise StoredLayoutError(f"{type(exc).__name__}: {exc}") from exc


# -- EngineLayout <-> plain data ------------------------------------------------------------


class _Names:
    """Each name once: the data points at names by their index here."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}

    def __call__(self, name: str) -> int:
        return self.index.setdefault(name, len(self.index))


def _engine_data(layout: EngineLayout) -> dict[str, Any]:
    name = _Names()
    groups = [
        [
            [name(n) for n in g.group.inputs], [name(n) for n in g.group.outputs], g.group.nbytes,
            [
                [
                    name(p.slot.name), p.slot.offset, list(p.slot.shape), _dtype_name(p.slot.dtype), p.slot.nbytes,
                    [x for r in p.regions for x in (name(r.param), r.param_offset, r.buffer_offset, r.nbytes)],
                    None if p.blocks is None else [
                        [-1 if b.source is None else name(b.source), list(b.sizes), b.dst_offset, list(b.dst_strides),
                         b.src_offset, list(b.src_strides), b.value]
                        for b in p.blocks
                    ],
                ]
                for p in g.params
            ],
            g.traced,
        ]
        for g in layout.compiled_groups()
    ]
    left_alone = [name(n) for n in layout.left_alone()]
    return {"names": list(name.index), "groups": groups, "left_alone": left_alone, "shared": layout.shared_groups}


def _engine_layout(data: dict[str, Any], table: TargetTable, rank_model: Callable[[], RankModel]) -> EngineLayout:
    names = [_text(n) for n in data["names"]]

    def name(i: Any) -> str:
        if _int(i) < 0:
            raise StoredLayoutError(f"name index {i}")
        return names[i]

    groups = []
    for inputs, outputs, nbytes, params, traced in data["groups"]:
        group = ParamGroup(tuple(name(i) for i in inputs), tuple(name(i) for i in outputs), _int(nbytes))
        restored = []
        for slot_name, offset, shape, dtype, slot_bytes, regions, blocks in params:
            slot = _Slot(name(slot_name), _int(offset), _ints(shape), _dtype(dtype), _int(slot_bytes))
            flat = _ints(regions)
            if len(flat) % 4:
                raise StoredLayoutError(f"{slot.name}: regions of {len(flat)} numbers")
            spans = [Region(name(flat[i]), *flat[i + 1 : i + 4]) for i in range(0, len(flat), 4)]
            restored.append(_Param(slot, spans, None if blocks is None else [_block(b, name) for b in blocks]))
        if not isinstance(traced, bool):
            raise StoredLayoutError(f"{group.outputs[0]}: traced {traced!r}")
        groups.append(_Group(group, restored, traced))
    left_alone = [name(i) for i in data["left_alone"]]
    return EngineLayout.restored(table, groups, left_alone, _int(data["shared"]), rank_model)


def _block(data: Sequence[Any], name: Callable[[Any], str]) -> Block:
    source, sizes, dst_offset, dst_strides, src_offset, src_strides, value = data
    if not isinstance(value, float):
        raise StoredLayoutError(f"a block's value {value!r}")
    return Block(
        None if source == -1 else name(source), _ints(sizes), _int(dst_offset), _ints(dst_strides),
        _int(src_offset), _ints(src_strides), value,
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, _text(name), None)
    if not isinstance(dtype, torch.dtype):
        raise StoredLayoutError(f"dtype {name!r}")
    return dtype


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise StoredLayoutError(f"{value!r} where a name belongs")
    return value


def _int(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise StoredLayoutError(f"{value!r} where an integer belongs")
    return value


def _ints(values: Any) -> tuple[int, ...]:
    if not isinstance(values, list):
        raise StoredLayoutError(f"{values!r} where a list of integers belongs")
    return tuple(_int(v) for v in values)
