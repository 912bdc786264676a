"""The plain data: target tables across the rendezvous, sizes, ids."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2psync.core.errors import RendezvousError
from p2psync.core.types import ParamSpec, SenderGroup, TargetId, TargetParam, TargetTable, dtype_size, numel


def make_table(**changes: object) -> TargetTable:
    table = TargetTable(
        engine_id="engine-a",
        rank=1,
        world_size=2,
        engine="sglang",
        layout_key={"tp": 2, "tp_rank": 1, "dtype": "bfloat16", "moe": {"backend": "triton", "ep": 1}},
        transport="mooncake",
        transport_info={"session": "127.0.0.7:15001", "protocol": "tcp"},
        control_url="http://127.0.0.7:30000",
        params=(
            TargetParam(
                "model.layers.0.self_attn.qkv_proj.weight", (3072, 2048), "bfloat16", 0x7F0000001000, 3072 * 2048 * 2
            ),
            TargetParam("model.norm.weight", (2048,), "float32", 0x7F0000C01000, 2048 * 4),
            TargetParam("lm_head.scale", (), "float8_e4m3fn", 0x7F0000C03000, 1),
        ),
        job_id="job-17",
        extra={"weight_version": "step-3"},
    )
    return replace(table, **changes)


def test_target_table_json_round_trip() -> None:
    table = make_table()
    text = table.to_json()
    assert TargetTable.from_json(text) == table
    assert TargetTable.from_json(text.encode()) == table
    back = TargetTable.from_json(text)
    assert back.params[0].shape == (3072, 2048) and isinstance(back.params[0].shape, tuple)
    assert back.params[2].shape == ()
    assert back.target == TargetId("engine-a", 1)
    assert back.nbytes == 3072 * 2048 * 2 + 2048 * 4 + 1
    assert back.to_json() == text  # canonical: a second trip changes nothing


def test_target_table_defaults_survive_the_round_trip() -> None:
    table = TargetTable("e", 0, 1, "torch", {}, "mooncake", {}, "", ())
    assert TargetTable.from_json(table.to_json()) == table


def test_layout_key_text_is_canonical_and_includes_the_engine() -> None:
    a = make_table(layout_key={"tp": 2, "dtype": "bfloat16"})
    b = make_table(layout_key={"dtype": "bfloat16", "tp": 2}, engine_id="engine-b")
    assert a.layout_key_text == b.layout_key_text
    assert json.loads(a.layout_key_text) == {"engine": "sglang", "tp": 2, "dtype": "bfloat16"}
    assert make_table(engine="vllm").layout_key_text != a.layout_key_text
    assert make_table(layout_key={"tp": 4, "dtype": "bfloat16"}).layout_key_text != a.layout_key_text


def valid_text() -> str:
    return make_table().to_json()


def _edit(change) -> str:  # type: ignore[no-untyped-def]
    raw = json.loads(valid_text())
    change(raw)
    return json.dumps(raw)


def _pop(key: str):  # type: ignore[no-untyped-def]
    return lambda raw: raw.pop(key)


def _set(key: str, value: object):  # type: ignore[no-untyped-def]
    return lambda raw: raw.__setitem__(key, value)


def _set_param(key: str, value: object):  # type: ignore[no-untyped-def]
    return lambda raw: raw["params"][0].__setitem__(key, value)


CORRUPTED = {
    "truncated in half": lambda: valid_text()[: len(valid_text()) // 2],
    "last byte cut": lambda: valid_text()[:-1],
    "empty": lambda: "",
    "not json": lambda: "<html>502 Bad Gateway</html>",
    "invalid utf-8": lambda: b"\xff\xfe{" + valid_text().encode(),
    "json array": lambda: "[1, 2, 3]",
    "params missing": lambda: _edit(_pop("params")),
    "params not a list": lambda: _edit(_set("params", 7)),
    "rank missing": lambda: _edit(_pop("rank")),
    "unknown field": lambda: _edit(_set("surprise", 1)),
    "param without addr": lambda: _edit(lambda raw: raw["params"][0].pop("addr")),
    "param shape not numbers": lambda: _edit(_set_param("shape", ["a", "b"])),
    "param shape a number": lambda: _edit(_set_param("shape", 5)),
    "param nbytes not a number": lambda: _edit(_set_param("nbytes", "lots")),
    "param not an object": lambda: _edit(lambda raw: raw["params"].__setitem__(0, "qkv")),
}


@pytest.mark.parametrize("name", list(CORRUPTED))
def test_corrupted_table_raises_rendezvous_error(name: str) -> None:
    with pytest.raises(RendezvousError, match="target table does not parse: "):
        TargetTable.from_json(CORRUPTED[name]())


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("null", id="null"),
        pytest.param('"a string"', id="string"),
        pytest.param("42", id="number"),
    ],
)
def test_table_json_that_is_not_an_object_raises_rendezvous_error(text: str) -> None:
    with pytest.raises(RendezvousError, match="target table does not parse"):
        TargetTable.from_json(text)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_every_truncation_raises_rendezvous_error(data: st.DataObject) -> None:
    text = valid_text()
    cut = data.draw(st.integers(0, len(text) - 1))
    with pytest.raises(RendezvousError, match="target table does not parse"):
        TargetTable.from_json(text[:cut])


@pytest.mark.parametrize(
    ("shape", "dtype", "nbytes", "holds"),
    [
        ([3072, 2048], "bfloat16", 3072 * 2048 * 2 - 2, 3072 * 2048 * 2),  # one element short
        ([3072, 2048], "bfloat16", 3072 * 2048 * 4, 3072 * 2048 * 2),  # float32 size, bfloat16 dtype
        ([3072, 1024], "bfloat16", 3072 * 2048 * 2, 3072 * 1024 * 2),  # shape of another rank
        ([], "float32", 0, 4),  # a scalar holds one element
    ],
)
def test_nbytes_inconsistent_with_shape_raises(shape: list[int], dtype: str, nbytes: int, holds: int) -> None:
    raw = json.loads(valid_text())
    raw["params"][0].update(shape=shape, dtype=dtype, nbytes=nbytes)
    with pytest.raises(RendezvousError) as info:
        TargetTable.from_json(json.dumps(raw))
    message = str(info.value)
    assert "'engine-a' rank 1" in message
    assert "'model.layers.0.self_attn.qkv_proj.weight'" in message
    assert f"says {nbytes} bytes" in message
    assert f"holds {holds}" in message


def test_unknown_dtype_in_table_raises() -> None:
    raw = json.loads(valid_text())
    raw["params"][1]["dtype"] = "float4_e2m1"
    with pytest.raises(RendezvousError, match="unknown dtype 'float4_e2m1'"):
        TargetTable.from_json(json.dumps(raw))


def test_param_spec_nbytes() -> None:
    assert ParamSpec("w", (4, 8), "bfloat16").nbytes == 64
    assert ParamSpec("w", (4, 8), "float32").nbytes == 128
    assert ParamSpec("w", (3,), "float8_e4m3fn").nbytes == 3
    assert ParamSpec("s", (), "float64").nbytes == 8
    assert ParamSpec("e", (0, 16), "float32").nbytes == 0


def test_dtype_sizes_match_torch() -> None:
    torch = pytest.importorskip("torch")
    for name in ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
                 "float8_e4m3fn", "float8_e5m2"):
        assert dtype_size(name) == torch.empty((), dtype=getattr(torch, name)).element_size(), name


def test_unknown_dtype_raises() -> None:
    with pytest.raises(RendezvousError, match="unknown dtype 'complex64'"):
        dtype_size("complex64")


def test_numel() -> None:
    assert numel(()) == 1
    assert numel((2, 3, 4)) == 24
    assert numel((5, 0)) == 0


def test_target_id_text_and_equality() -> None:
    assert str(TargetId("engine-a", 3)) == "engine-a[3]"
    assert TargetId("engine-a", 3) == TargetId("engine-a", 3)
    assert len({TargetId("engine-a", 3), TargetId("engine-a", 3), TargetId("engine-b", 3)}) == 2


def test_sender_group_index() -> None:
    group = SenderGroup("pp1", (8, 9, 10, 11), 10)
    assert group.index == 2
