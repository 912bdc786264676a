"""fp8 engines through the layouts room alone, with a toy fp8 engine built from a plain torch class
(runs in tox -e py; sglang and vLLM fp8 engines: tests/adapters/sglang/test_fp8.py, tests/adapters/vllm/test_fp8.py).

The toy engine holds what fp8 engines hold: a fused, tensor-parallel `gate_up` weight in
float8_e4m3fn with its block scales (split by rows as the weight), a row-split `down` weight (split by
columns) with its scales, a bf16 router and norm it does not quantize, a bf16 vocabulary split by
rows, and a kv-cache scale its loader never writes. Its loader ignores names it does not know.
The oracle is the toy's own loader fed the fp8 checkpoint: the quantizer's tensors of the bf16 cast
of each weight the toy holds in fp8 (tests/layouts/test_quantizers.py checks the quantizers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest
import torch
from torch import nn

from p2psync.conformance import EngineCase, EngineTargetTests
from p2psync.conformance.base import specs_of
from p2psync.engine.endpoint import EndpointControl, EngineEndpoint
from p2psync.core.errors import ConnectError
from p2psync.core.rendezvous import Rendezvous
from p2psync.trainer.session import Session
from p2psync.core.types import TargetParam, TargetTable
from p2psync.layouts import EngineQuantization, RankModel, RankModelTarget, quantizers

VOCAB, HIDDEN, INTER, EXPERTS, BLOCK = 40, 16, 32, 4, 8
FP8 = torch.float8_e4m3fn
QUANTIZER = quantizers.get("block-linear", [BLOCK, BLOCK])
QUANTIZED = ("up", "gate", "down")


class Fp8ToyModel(nn.Module):
    """The toy engine's model of TP rank `rank` of `tp` and its loader of an fp8 checkpoint.
    `shared_up`: a bf16 copy of `up` beside the fp8 `gate_up`, which `up.weight` feeds too."""

    def __init__(self, tp: int, rank: int, shared_up: bool = False) -> None:
        super().__init__()
        self.tp, self.rank, rows = tp, rank, INTER // tp
        self.embed = nn.Parameter(torch.empty(VOCAB // tp, HIDDEN, dtype=torch.bfloat16))
        self.gate_up = nn.Parameter(torch.empty(2 * rows, HIDDEN, dtype=FP8), requires_grad=False)
        self.gate_up_scale_inv = nn.Parameter(torch.empty(2 * rows // BLOCK, HIDDEN // BLOCK))
        self.down = nn.Parameter(torch.empty(HIDDEN, rows, dtype=FP8), requires_grad=False)
        self.down_scale_inv = nn.Parameter(torch.empty(HIDDEN // BLOCK, rows // BLOCK))
        self.router = nn.Parameter(torch.empty(EXPERTS, HIDDEN, dtype=torch.bfloat16))
        self.norm = nn.Parameter(torch.empty(HIDDEN, dtype=torch.bfloat16))
        self.kv_scale = nn.Parameter(torch.empty((), dtype=torch.float32))
        if shared_up:
            self.up_bf16 = nn.Parameter(torch.empty(rows, HIDDEN, dtype=torch.bfloat16))

    def load_weights(self, items: Sequence[tuple[str, torch.Tensor]]) -> None:
        r, rows = self.rank, INTER // self.tp
        for name, w in items:
            leaf, _, kind = name.partition(".")
            if leaf in ("gate", "up"):
                at = 0 if leaf == "gate" else 1
                if kind == "weight":
                    self.gate_up.data[at * rows : (at + 1) * rows].copy_(w[r * rows : (r + 1) * rows])
                    if leaf == "up" and hasattr(self, "up_bf16"):
                        self.up_bf16.data.copy_(w[r * rows : (r + 1) * rows])
                elif kind == "weight_scale_inv":
                    n = rows // BLOCK
                    self.gate_up_scale_inv.data[at * n : (at + 1) * n].copy_(w[r * n : (r + 1) * n])
            elif name == "down.weight":
                self.down.data.copy_(w[:, r * rows : (r + 1) * rows])
            elif name == "down.weight_scale_inv":
                n = rows // BLOCK
                self.down_scale_inv.data.copy_(w[:, r * n : (r + 1) * n])
            elif name == "embed.weight":
                part = VOCAB // self.tp
                self.embed.data.copy_(w[r * part : (r + 1) * part])
            elif name in ("router.weight", "norm.weight"):
                getattr(self, leaf).data.copy_(w)
            # anything else: ignored, as engines skip checkpoint tensors they do not hold


def trainer_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """The trainer's HF tensors, float32."""
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "embed.weight": (VOCAB, HIDDEN), "gate.weight": (INTER, HIDDEN), "up.weight": (INTER, HIDDEN),
        "down.weight": (HIDDEN, INTER), "router.weight": (EXPERTS, HIDDEN), "norm.weight": (HIDDEN,),
    }
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def fp8_checkpoint(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.split(".")[0] in QUANTIZED:
            out.update(QUANTIZER.quantize(name, t.to(torch.bfloat16)))
        else:
            out[name] = t
    return out


class Fp8ToyRankModel(RankModel):
    def __init__(self, tp: int, rank: int, device: str = "meta", shared_up: bool = False) -> None:
        with torch.device(device):
            self.model = Fp8ToyModel(tp, rank, shared_up)

    def load(self, items: Sequence[tuple[str, torch.Tensor]]) -> None:
        self.model.load_weights(items)

    def unloaded_params(self) -> frozenset[str]:
        return frozenset({"kv_scale"})


class Fp8ToyTarget(RankModelTarget):
    name = "fp8-toy"

    def rank_model(self, table: TargetTable) -> RankModel:
        return Fp8ToyRankModel(table.layout_key["tp"], table.rank, shared_up=table.layout_key.get("shared_up", False))

    def quantization(self, table: TargetTable) -> EngineQuantization | None:
        return EngineQuantization(table.layout_key["quantization_config"], "bfloat16")

    def control(self, tables, *, timeout, token=""):
        return EndpointControl(tables, timeout=timeout, token=token)


def layout_key(tp: int, **extra) -> dict:
    return {"tp": tp, "quantization_config": QUANTIZER.quantization_config(), **extra}


def engine_rank(tp: int, rank: int, tensors: dict[str, torch.Tensor], **key) -> tuple[Fp8ToyModel, dict, TargetTable]:
    """A rank whose memory starts as 0xA5 bytes, what its own loader leaves there from the fp8
    checkpoint of `tensors`, and its table."""
    engine, loaded = (Fp8ToyRankModel(tp, rank, "cpu", **key).model for _ in range(2))
    for p in [*engine.parameters(), *loaded.parameters()]:
        p.data.reshape(-1).view(torch.uint8).fill_(0xA5)
    loaded.load_weights(list(fp8_checkpoint(tensors).items()))
    table = TargetTable(
        engine_id="fp8-toy-0", rank=rank, world_size=tp, engine="fp8-toy", layout_key=layout_key(tp, **key),
        transport="samehost", transport_info={}, control_url="", job_id="j",
        params=tuple(
            TargetParam(n, tuple(p.shape), str(p.dtype).removeprefix("torch."), p.data_ptr(), p.nbytes)
            for n, p in engine.named_parameters()
        ),
    )
    return engine, {n: p.data for n, p in loaded.named_parameters()}, table


def produced(layout, tensors: dict[str, torch.Tensor], table: TargetTable) -> dict[str, torch.Tensor]:
    held = {p.name: torch.full((p.nbytes,), 0xA5, dtype=torch.uint8) for p in table.params}
    for group in layout.groups():
        out = torch.zeros(group.nbytes, dtype=torch.uint8)
        for r in layout.fill(group, tensors, out):
            written = out[r.buffer_offset : r.buffer_offset + r.nbytes]
            held[r.param][r.param_offset : r.param_offset + r.nbytes] = written
    return held


@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 1)])
class TestFp8ToyEngine(EngineTargetTests):
    conformance = {"engine": "fp8-toy"}

    @pytest.fixture
    def engine_case(self, tp, rank):
        tensors = trainer_tensors()
        engine, expected, table = engine_rank(tp, rank, tensors)
        initial = {n: p.data.clone() for n, p in engine.named_parameters()}  # 0xA5: kv_scale keeps it, loaded or not
        return EngineCase(table, tensors, initial, expected, Fp8ToyTarget().layout)


@pytest.mark.parametrize("mode", ["copy_map", "replica"])
def test_every_byte_equals_the_toys_own_load_of_the_fp8_checkpoint(mode):
    tensors = trainer_tensors()
    for rank in range(2):
        _, expected, table = engine_rank(2, rank, tensors)
        layout = Fp8ToyTarget(layout=mode).layout(table, specs_of(tensors))
        held = produced(layout, tensors, table)
        for name, tensor in expected.items():
            assert torch.equal(held[name], tensor.reshape(-1).view(torch.uint8)), (mode, rank, name)


def test_what_feeds_fp8_parameters_is_quantized_and_gathered_in_the_engine_dtype():
    tensors = trainer_tensors()
    _, _, table = engine_rank(2, 0, tensors)
    layout = Fp8ToyTarget().layout(table, specs_of(tensors))
    assert layout.quantized == {"gate.weight", "up.weight", "down.weight"}, "the bf16 router stays as it is"
    assert layout.loader_params == [], "fp8 weights and their scales are copy maps"
    groups = {g.outputs: g for g in layout.groups()}
    gate_up = groups[("gate_up", "gate_up_scale_inv")]
    assert gate_up.inputs == ("gate.weight", "up.weight"), "a weight and its scale are one group"
    assert layout.copy_dtype(gate_up) == "bfloat16", "quantized from bf16, never gathered as fp8"
    assert layout.copy_runs(gate_up, {"gate.weight": [(0, 8)]}) is None, "blocks span trainer shards"
    router = groups[("router",)]
    assert layout.copy_dtype(router) == "bfloat16"
    assert layout.copy_runs(router, {"router.weight": [(0, 8)]}), "unquantized groups stay gather-free"


def test_bytes_do_not_depend_on_the_trainers_dtype():
    """Quantizer inputs are cast to the engine's bf16 first: a trainer holding float32 or bf16
    sends the same bytes, so gathers may move bf16."""
    tensors = trainer_tensors()
    _, _, table = engine_rank(2, 1, tensors)
    layout = Fp8ToyTarget().layout(table, specs_of(tensors))
    narrow = {n: t.to(torch.bfloat16) for n, t in tensors.items()}
    wide, cast = produced(layout, tensors, table), produced(layout, narrow, table)
    assert all(torch.equal(wide[n], cast[n]) for n in wide)
    fp32_quantized = QUANTIZER.quantize("up.weight", tensors["up.weight"])["up.weight"]
    bf16_quantized = QUANTIZER.quantize("up.weight", narrow["up.weight"])["up.weight"]
    assert not torch.equal(fp32_quantized.view(torch.uint8), bf16_quantized.view(torch.uint8)), "the cast matters"


# --- refused at connect, before anything is written ---------------------------------------------


def refused(table: TargetTable, sources, **options) -> str:
    with pytest.raises(ConnectError, match=f"^engine 'fp8-toy-0' rank {table.rank}: ") as info:
        Fp8ToyTarget(**options).layout(table, sources)
    return str(info.value)


def test_a_trainer_tensor_already_fp8_is_refused():
    tensors = trainer_tensors()
    _, _, table = engine_rank(2, 1, tensors)
    sources = specs_of({**tensors, "down.weight": tensors["down.weight"].to(FP8)})
    assert "trainer tensor 'down.weight' is already fp8; quantizer 'block-linear' takes bf16, fp16 or fp32" in refused(
        table, sources
    )


def test_a_tensor_feeding_fp8_and_unquantized_parameters_is_refused():
    tensors = trainer_tensors()
    _, _, table = engine_rank(2, 1, tensors, shared_up=True)
    text = refused(table, specs_of(tensors))
    assert "HF tensor 'up.weight' feeds fp8 and unquantized parameters (gate_up, up_bf16)" in text


def test_a_trainer_tensor_named_like_a_scale_is_refused():
    tensors = trainer_tensors()
    _, _, table = engine_rank(2, 1, tensors)
    sources = specs_of({**tensors, "up.weight_scale_inv": torch.ones(4, 2)})
    assert "the trainer has a tensor 'up.weight_scale_inv', the name of 'up.weight''s scale" in refused(table, sources)


def test_scales_the_engine_loads_into_nothing_are_refused(monkeypatch):
    tensors = trainer_tensors()
    _, _, table = engine_rank(2, 1, tensors)
    monkeypatch.setattr(quantizers.Quantizer, "scale_suffix", property(lambda self: "weight_scale"))
    text = refused(table, specs_of(tensors))
    assert "the engine holds no scale 'gate.weight_scale' (quantizer 'block-linear' names its scales " \
        "`...weight_scale`; fp8-toy's loader loads it into no parameter; nor 2 more scales)" in text


def test_a_quantizer_the_engine_does_not_serve_is_refused():
    tensors = trainer_tensors()
    _, _, table = engine_rank(2, 1, tensors)
    text = refused(table, specs_of(tensors), quantizer="per-tensor")
    assert "quantizer 'per-tensor': engine weight_block_size is [8, 8], ours is None" in text


# --- through a Session ----------------------------------------------------------------------------


@pytest.fixture
def toy_engines():
    from p2psync.core.plugins import registry

    registry().add("engine_targets", Fp8ToyTarget, "tests", "0")
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="fp8-toy", is_server=True, timeout=10)
    endpoints = []

    def serve(ranks):
        for engine, _, table in ranks:
            endpoints.append(EngineEndpoint.serve(
                engine="fp8-toy", engine_id="fp8-toy-0", rank=engine.rank, world_size=engine.tp,
                params={name: p.data for name, p in engine.named_parameters()}, layout_key=table.layout_key,
                transport="samehost", rendezvous=rendezvous,
            ))
        return rendezvous

    try:
        yield serve
    finally:
        for endpoint in endpoints:
            endpoint.close()
        del registry().entries["engine_targets"]["fp8-toy"]


def trainer_model(tensors: dict[str, torch.Tensor]) -> nn.Module:
    model = nn.Module()
    for name, t in tensors.items():
        leaf = name.split(".")[0]
        setattr(model, leaf, nn.Module())
        getattr(model, leaf).weight = nn.Parameter(t.clone(), requires_grad=t.is_floating_point() and t.itemsize > 1)
    return model


def test_a_session_updates_fp8_toy_engines_bit_exact_and_checked(toy_engines):
    from p2psync.adapters.fsdp2 import FSDP2Source

    tensors = trainer_tensors(seed=1)
    ranks = [engine_rank(2, r, tensors) for r in range(2)]
    rendezvous = toy_engines(ranks)
    source = FSDP2Source(trainer_model(tensors))
    with Session(source=source, transport="samehost", rendezvous=rendezvous, check=True) as s:
        s.connect(["fp8-toy-0"])
        assert s.update("v1").ok
    for engine, expected, _ in ranks:
        for name, p in engine.named_parameters():
            assert torch.equal(p.data.reshape(-1).view(torch.uint8), expected[name].reshape(-1).view(torch.uint8)), name


def test_a_session_refuses_an_fp8_trainer_tensor_and_writes_nothing(toy_engines):
    from p2psync.adapters.fsdp2 import FSDP2Source

    tensors = trainer_tensors(seed=1)
    ranks = [engine_rank(2, r, tensors) for r in range(2)]
    before = [{n: p.data.clone() for n, p in engine.named_parameters()} for engine, _, _ in ranks]
    rendezvous = toy_engines(ranks)
    trainer = trainer_model({**tensors, "gate.weight": tensors["gate.weight"].to(FP8)})
    with Session(source=FSDP2Source(trainer), transport="samehost", rendezvous=rendezvous) as s:
        with pytest.raises(ConnectError, match="rank 0: trainer tensor 'gate.weight' is already fp8"):
            s.connect(["fp8-toy-0"])
    for (engine, _, _), old in zip(ranks, before):
        for name, p in engine.named_parameters():
            assert torch.equal(p.data.reshape(-1).view(torch.uint8), old[name].reshape(-1).view(torch.uint8)), name


def test_options_name_the_quantizers():
    with pytest.raises(Exception, match="quantizer='block-nonsense' is not 'block-linear' | 'block-linear-verl-torch'"):
        Fp8ToyTarget(quantizer="block-nonsense")
    assert dataclasses.asdict(Fp8ToyTarget(quantizer="block-ue8m0").options)["quantizer"] == "block-ue8m0"
