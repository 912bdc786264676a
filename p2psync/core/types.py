"""The plain data p2psync passes between trainer, engines and rendezvous.

Everything here is JSON-serializable so that a target table can cross the
rendezvous and be read by a trainer that imports no engine framework.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import RendezvousError


@dataclass(frozen=True)
class ParamSpec:
    """A full HF tensor as the trainer holds it: name, shape and dtype (torch name, e.g. 'bfloat16')."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * dtype_size(self.dtype)


@dataclass(frozen=True)
class TargetParam:
    """One engine parameter as registered with the transport: where its bytes live."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    addr: int
    nbytes: int


@dataclass(frozen=True)
class TargetId:
    """One engine rank."""

    engine_id: str
    rank: int

    def __str__(self) -> str:
        return f"{self.engine_id}[{self.rank}]"


@dataclass(frozen=True)
class TargetTable:
    """What an engine rank publishes: its parameters, layout key, transport and control address.

    `layout_key` holds everything that decides the bytes of this rank besides the
    rank index itself; equal key and rank mean equal bytes, so one layout and one
    filled buffer can serve several engines. `instance` names the process that
    published it (host, pid, a random part); `incarnation` counts the processes that
    have served this engine rank, so that a restart replaces its predecessor openly. `node`
    names the network it published from (`core.host.node_id`): a trainer on another node
    refuses a host-local address in it.
    """

    engine_id: str
    rank: int
    world_size: int
    engine: str
    layout_key: dict[str, Any]
    transport: str
    transport_info: dict[str, Any]
    control_url: str
    params: tuple[TargetParam, ...]
    job_id: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    incarnation: int = 0
    instance: str = ""
    patch_area: tuple[int, int] | None = None
    node: str = ""

    @property
    def target(self) -> TargetId:
        return TargetId(self.engine_id, self.rank)

    @functools.cached_property
    def layout_key_text(self) -> str:
        """Canonical text of the layout key, usable as a dictionary key (computed once per table)."""
        return json.dumps({"engine": self.engine, **self.layout_key}, sort_keys=True)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    @property
    def writable(self) -> list[tuple[int, int]]:
        """(address, bytes) of all the memory trainers write: parameters and patch area."""
        spans = [(p.addr, p.nbytes) for p in self.params]
        return spans + ([self.patch_area] if self.patch_area is not None else [])

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> TargetTable:
        try:
            raw = json.loads(text)
            if not isinstance(raw, dict):
                raise TypeError(f"expected a JSON object, got {type(raw).__name__}")
            params = tuple(
                TargetParam(
                    name=str(p["name"]),
                    shape=tuple(int(d) for d in p["shape"]),
                    dtype=str(p["dtype"]),
                    addr=int(p["addr"]),
                    nbytes=int(p["nbytes"]),
                )
                for p in raw.pop("params")
            )
            area = raw.pop("patch_area", None)
            patch_area = None if area is None else (int(area[0]), int(area[1]))
            table = cls(params=params, patch_area=patch_area, **raw)
        except (ValueError, KeyError, TypeError) as exc:
            raise RendezvousError(f"target table does not parse: {exc!s}") from exc
        for p in table.params:
            if p.nbytes != numel(p.shape) * dtype_size(p.dtype):
                raise RendezvousError(
                    f"target table of engine {table.engine_id!r} rank {table.rank}: parameter "
                    f"{p.name!r} says {p.nbytes} bytes, but shape {list(p.shape)} of {p.dtype} "
                    f"holds {numel(p.shape) * dtype_size(p.dtype)}"
                )
        return table


@dataclass(frozen=True)
class Region:
    """Bytes a layout produced for one parameter: `nbytes` at `buffer_offset` of the
    transfer buffer go to `param_offset` of the target parameter."""

    param: str
    param_offset: int
    buffer_offset: int
    nbytes: int


@dataclass(frozen=True)
class SenderGroup:
    """Trainer ranks that hold the same HF tensors after gathering.

    `ranks` are global trainer ranks (torch.distributed world ranks); `rank` is this
    process's. `group_id` tells groups apart (one per pipeline stage for Megatron).
    """

    group_id: str
    ranks: tuple[int, ...]
    rank: int

    @property
    def index(self) -> int:
        return self.ranks.index(self.rank)


_DTYPE_SIZES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}


def dtype_size(dtype: str) -> int:
    try:
        return _DTYPE_SIZES[dtype]
    except KeyError:
        raise RendezvousError(f"unknown dtype {dtype!r}") from None


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
