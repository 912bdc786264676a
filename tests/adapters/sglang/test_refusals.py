"""sglang targets a layout cannot reproduce, and sglang servers whose weights p2psync cannot
address, are refused naming engine and rank (and the parameter where one is at fault), before
anything is written (environment conformance-sglang)."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

pytest.importorskip("sglang", reason="sglang (p2psync[sglang], sglang==0.5.23) is not installed; run `tox -e conformance-sglang`")
pytest.importorskip("mooncake.engine", reason="Mooncake (p2psync[mooncake]) is not installed")

from p2psync.adapters.sglang.server import publish_server  # noqa: E402
from p2psync.adapters.sglang.shim import RankSpec, build_rank_model  # noqa: E402
from p2psync.core.errors import ConnectError, RendezvousError  # noqa: E402
from p2psync.core.rendezvous import Rendezvous  # noqa: E402
from tests.helpers.doubles import refusal  # noqa: E402
from tests.helpers.sglang_models import config_dict, hf_config, hf_tensors, sglang_rank  # noqa: E402

TP, RANK = 2, 1


def key(**changes: Any):
    return lambda table: {"layout_key": {**table.layout_key, **changes}}


def extra_param(table):
    extra = dataclasses.replace(table.params[0], name="model.layers.9.mlp.gate_up_proj.weight")
    return {"params": (*table.params, extra)}


TARGET_REFUSALS = {
    "another sglang version": (key(sglang="0.0.1"), "engine runs sglang 0.0.1, the trainer has sglang"),
    "a config that does not match its hash": (key(config_sha256="0" * 64), "does not match its hash"),
    "EPLB": (key(enable_eplb=True), "enable_eplb=True: EPLB moves experts"),
    "redundant experts": (key(ep_num_redundant_experts=2), "ep_num_redundant_experts=2"),
    "pipeline parallel": (key(pp_size=2), "pp_size=2: pipeline parallelism"),
    "data-parallel attention": (key(enable_dp_attention=True), "enable_dp_attention=True"),
    "quantized": (key(quantization="fp8"), "quantization='fp8'"),
    "a parameter sglang's rank model lacks": (
        extra_param, "parameter 'model.layers.9.mlp.gate_up_proj.weight': published, but not a parameter"
    ),
}


@pytest.fixture(scope="module")
def qwen3() -> tuple[dict, Any]:
    tensors = hf_tensors(hf_config("qwen3"))
    _, table = sglang_rank(config_dict(hf_config("qwen3")), TP, 1, RANK, tensors)
    return tensors, table


@pytest.mark.parametrize("case", sorted(TARGET_REFUSALS))
def test_a_target_no_layout_reproduces_is_refused_before_anything_is_written(case: str, qwen3) -> None:
    change, reason = TARGET_REFUSALS[case]
    tensors, table = qwen3
    valid_rank0 = dataclasses.replace(table, rank=0)
    message, opened = refusal([valid_rank0, dataclasses.replace(table, **change(table))], tensors)
    assert f"engine 'engine-0' rank {RANK}" in message and reason in message, message
    assert opened == []


@contextmanager
def fake_server(info: dict[str, Any], weights: dict[str, list[int]]) -> Iterator[tuple[str, list[str]]]:
    """An HTTP server answering what publish_server reads of a real sglang server; its URL and
    the paths of every POST it received (a control call: none may come)."""
    posts: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/get_server_info":
                self._reply(info)
            else:  # /remote_instance_transfer_engine_info?rank=0
                self._reply({"rank": 0, "remote_instance_transfer_engine_info": ["127.0.0.1:1", weights]})

        def do_POST(self) -> None:  # noqa: N802
            posts.append(self.path)
            self._reply({})

        def _reply(self, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", posts
    finally:
        server.shutdown()


def server_info(dtype: str = "bfloat16") -> dict[str, Any]:
    return {
        "dtype": dtype, "tp_size": 1, "ep_size": 1, "version": "0.5.23", "moe_a2a_backend": "none",
        "moe_runner_backend": "auto", "enable_eplb": False, "ep_num_redundant_experts": 0,
        "init_expert_location": "trivial", "pp_size": 1, "enable_dp_attention": False, "quantization": None,
    }


def weights_of(config: dict[str, Any]) -> dict[str, list[int]]:
    """What a server holding `config`'s model registers: per parameter, address, elements, element size."""
    model = build_rank_model(RankSpec(config, 1, 1, "bfloat16", 0), "meta").model
    return {n: [4096 * (i + 1), p.numel(), p.element_size()] for i, (n, p) in enumerate(model.named_parameters())}


def without(weights: dict[str, list[int]], name: str) -> dict[str, list[int]]:
    return {n: w for n, w in weights.items() if n != name}


def miscounted(weights: dict[str, list[int]], name: str) -> dict[str, list[int]]:
    return {n: [w[0], w[1] - 1, w[2]] if n == name else w for n, w in weights.items()}


NAME = "model.layers.0.mlp.down_proj.weight"
SERVER_REFUSALS = {
    "no explicit dtype": ("qwen3", "auto", lambda w: w, "engine 'server': start the server with an explicit --dtype"),
    "a weight the server did not register": (
        "qwen3", "bfloat16", lambda w: without(w, NAME), f"engine 'server' rank 0 parameter '{NAME}': the server registered no such weight"
    ),
    "a weight of another size": (
        "qwen3", "bfloat16", lambda w: miscounted(w, NAME), f"engine 'server' rank 0 parameter '{NAME}': the server holds"
    ),
    "weights derived after loading (MLA)": (
        "deepseek_v3", "bfloat16", lambda w: w, "engine 'server' rank 0: DeepseekV3ForCausalLM derives weights after loading"
    ),
}


@pytest.mark.parametrize("case", sorted(SERVER_REFUSALS))
def test_a_server_whose_weights_cannot_be_addressed_is_refused_before_anything_is_published(case: str) -> None:
    kind, dtype, change, reason = SERVER_REFUSALS[case]
    config = config_dict(hf_config(kind))
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="refusals", is_server=True, timeout=1)
    with fake_server(server_info(dtype), change(weights_of(config))) as (url, posts):
        with pytest.raises(ConnectError) as error:
            publish_server(url, engine_id="server", rendezvous=rendezvous, hf_config=config)
    assert reason in str(error.value), str(error.value)
    assert posts == []  # no control call reached the server
    with pytest.raises(RendezvousError, match="not published within"):
        rendezvous.read_engine("server")  # nothing published: no trainer can write to it
