"""The toy engine of tests/layouts/test_add_an_engine.py: a third engine kind built from a plain torch
model class, with what an engine adapter writes (a rank model, a target, an endpoint), and a
trainer source of plain tensors that claims local shards. See that test's docstring."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from p2psync.core.rendezvous import Rendezvous
from p2psync.core.source import LocalShard
from p2psync.core.types import TargetParam, TargetTable
from p2psync.engine.endpoint import EndpointControl, EngineEndpoint
from p2psync.layouts import RankModel, RankModelTarget
from p2psync.trainer.session import Session
from tests.helpers.doubles import DictSource

VOCAB, HIDDEN, HEADS, HEAD_DIM, LAYERS = 50, 16, 4, 4, 2


def padded_vocab(tp: int) -> int:
    return -(-VOCAB // (8 * tp)) * 8 * tp


class ToyEngineModel(nn.Module):
    """The engine's model of TP rank `rank` of `tp`, and its own loader of HF tensors."""

    def __init__(self, tp: int, rank: int, layers: int = LAYERS) -> None:
        super().__init__()
        self.tp, self.rank = tp, rank
        heads = HEADS // tp
        self.embed = nn.Parameter(torch.empty(padded_vocab(tp) // tp, HIDDEN))
        self.layers = nn.ModuleList()
        for _ in range(layers):
            layer = nn.Module()
            layer.qkv = nn.Parameter(torch.empty(3 * heads * HEAD_DIM, HIDDEN))
            layer.o = nn.Parameter(torch.empty(HIDDEN, heads * HEAD_DIM))
            layer.norm = nn.Parameter(torch.empty(HIDDEN))
            self.layers.append(layer)
        self.head = nn.Module()
        self.head.weight = self.embed  # tied: one parameter, two holders

    def load_weights(self, items: Sequence[tuple[str, torch.Tensor]]) -> None:
        rows = HEADS // self.tp * HEAD_DIM
        for name, w in items:
            if name == "embed.weight":
                part = padded_vocab(self.tp) // self.tp
                first = self.rank * part
                real = max(0, min(part, VOCAB - first))
                self.embed.data[:real].copy_(w[first : first + real])
                self.embed.data[real:].zero_()
                continue
            _, index, leaf, _ = name.split(".")
            layer = self.layers[int(index)]
            if leaf in ("q", "k", "v"):
                at = "qkv".index(leaf) * rows
                layer.qkv.data[at : at + rows].copy_(w[self.rank * rows : (self.rank + 1) * rows])
            elif leaf == "o":
                layer.o.data.copy_(w[:, self.rank * rows : (self.rank + 1) * rows])
            else:
                layer.norm.data.copy_(w + 1)


def hf_model(seed: int, layers: int = LAYERS) -> nn.Module:
    """The trainer's model: the HF checkpoint names, one tensor per projection."""
    torch.manual_seed(seed)
    model = nn.Module()
    model.embed = nn.Embedding(VOCAB, HIDDEN)
    model.layers = nn.ModuleList()
    for _ in range(layers):
        layer = nn.Module()
        for leaf in "qkv":
            setattr(layer, leaf, nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False))
        layer.o = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        layer.norm = nn.LayerNorm(HIDDEN, bias=False)
        nn.init.normal_(layer.norm.weight)
        model.layers.append(layer)
    return model


# -- what an engine adapter writes: a rank model, a target, an endpoint ----------------------


class ToyRankModel(RankModel):
    def __init__(self, tp: int, rank: int, device: str = "meta", layers: int = LAYERS, model=ToyEngineModel) -> None:
        with torch.device(device):
            self.model = model(tp, rank, layers)

    def load(self, items: Sequence[tuple[str, torch.Tensor]]) -> None:
        self.model.load_weights(items)


class ToyTarget(RankModelTarget):
    name = "toy"

    def rank_model(self, table: TargetTable) -> RankModel:
        return ToyRankModel(table.layout_key["tp"], table.rank, layers=table.layout_key.get("layers", LAYERS))

    def control(self, tables, *, timeout, token=""):
        return EndpointControl(tables, timeout=timeout, token=token)


def serve_toy(model: ToyEngineModel, *, engine_id: str, rendezvous: Rendezvous, transport: str) -> EngineEndpoint:
    return EngineEndpoint.serve(
        engine="toy", engine_id=engine_id, rank=model.rank, world_size=model.tp,
        params={name: p.data for name, p in model.named_parameters()}, layout_key={"tp": model.tp},
        transport=transport, rendezvous=rendezvous,
    )


def engine_rank(
    tp: int, rank: int, sources: dict[str, torch.Tensor], layers: int = LAYERS, model: type = ToyEngineModel
) -> tuple[ToyEngineModel, dict, TargetTable]:
    """An engine rank whose memory starts as 0xA5 bytes, what its own loader leaves there, and its table."""
    engine = ToyRankModel(tp, rank, "cpu", layers, model).model
    for p in engine.parameters():
        p.data.view(torch.uint8).fill_(0xA5)
    loaded = ToyRankModel(tp, rank, "cpu", layers, model).model
    for p in loaded.parameters():
        p.data.view(torch.uint8).fill_(0xA5)
    loaded.load_weights(list(sources.items()))
    table = TargetTable(
        engine_id="toy-0", rank=rank, world_size=tp, engine="toy",
        layout_key={"tp": tp} | ({"layers": layers} if layers != LAYERS else {}), transport="samehost",
        transport_info={}, control_url="", job_id="j",
        params=tuple(
            TargetParam(n, tuple(p.shape), str(p.dtype).removeprefix("torch."), p.data_ptr(), p.numel() * p.element_size())
            for n, p in engine.named_parameters()
        ),
    )
    return engine, {n: p.data for n, p in loaded.named_parameters()}, table


class ShardSource(DictSource):
    """Plain tensors, of which this rank claims `claims[name]` (flat element ranges; default:
    all of each) as its local shards."""

    name = "test-shards"

    def __init__(self, tensors: dict[str, torch.Tensor], claims: dict[str, tuple] | None = None) -> None:
        super().__init__(tensors)
        self.claims = claims or {}

    def local_shards(self, names):
        out = {}
        for name in names:
            flat = self.tensors[name].reshape(-1)
            ranges = self.claims.get(name, ((0, flat.numel()),))
            out[name] = LocalShard(ranges, torch.cat([flat[a:b] for a, b in ranges]) if ranges else flat[:0])
        return out


@contextmanager
def toy_session(source: Any, tp: int = 2, **session: Any) -> Iterator[tuple[Session, list[ToyEngineModel]]]:
    """Engine toy-0's `tp` ranks (0xA5 bytes at first) served over samehost in this process,
    and a session of `source` (a trainer source) connected to them."""
    from p2psync.core.plugins import registry

    registry().add("engine_targets", ToyTarget, "tests", "0")
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="toy", is_server=True, timeout=10)
    engines = [engine_rank(tp, r, {})[0] for r in range(tp)]
    endpoints = [
        serve_toy(engine, engine_id="toy-0", rendezvous=rendezvous, transport="samehost") for engine in engines
    ]
    try:
        session.setdefault("transport", "samehost")
        with Session(source=source, rendezvous=rendezvous, check=True, **session) as s:
            s.connect(["toy-0"])
            yield s, engines
    finally:
        for endpoint in endpoints:
            endpoint.close()
        del registry().entries["engine_targets"]["toy"]
