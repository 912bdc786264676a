"""A real sglang server on CPU serving two LoRA adapters (`--enable-lora`, sglang's
torch_native LoRA kernels), adapter "a" updated from a trainer's PEFT adapter over Mooncake
through p2psync's plugin while a request on adapter "b" runs (environment conformance-sglang).

After the update, greedy generation on "a" is transformers + PEFT's with the trainer's adapter
(within bfloat16's reach of a tie), and the request on "b", in flight across the whole update,
ran to its end, neither paused nor aborted, generating what PEFT generates with "b"."""

from __future__ import annotations

import json
import threading
import time

import pytest

peft = pytest.importorskip("peft", reason="PEFT (p2psync[lora]) is not installed")

import torch  # noqa: E402

from p2psync.adapters.peft import LoraSource  # noqa: E402
from p2psync.adapters.sglang.server_plugin import ENDPOINT_ENV  # noqa: E402
from p2psync.core.control import http_json  # noqa: E402
from p2psync.core.rendezvous import Rendezvous  # noqa: E402
from p2psync.trainer.session import Session  # noqa: E402
from p2psync.worlds import PROMPT  # noqa: E402
from tests.helpers.peft_engine import ALL_LINEAR, lora_model  # noqa: E402
from tests.matrix.test_sglang_server import MODEL, assert_generated_by, generated_by, served, sglang_server  # noqa: E402

#: Long enough that the request on "b" spans the update of "a".
LONG = 160
#: Seconds the request on "b" runs before the update starts: a small share of its length
#: (160 tokens take about 0.8 s on two cores), enough for the scheduler to have taken it.
SETTLE = 0.2


def with_adapter(name: str, seed: int) -> torch.nn.Module:
    """The server's base model with one random LoRA adapter."""
    return lora_model({name: seed}, base=MODEL)


def generate(url: str, adapter: str, tokens: int = 8) -> dict:
    body = {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": tokens}, "lora_path": adapter}
    return http_json(url, "/generate", body, timeout=600)


@pytest.mark.slow
@pytest.mark.conformance(trainer="fsdp2", engine="sglang", transport="mooncake", via="sglang server lora")
def test_one_adapter_of_a_real_server_is_updated_while_a_request_on_another_runs_on(tmp_path):
    engine = {name: with_adapter(name, seed) for name, seed in (("a", 31), ("b", 32))}
    for name, model in engine.items():
        model.save_pretrained(tmp_path / "adapters", selected_adapters=[name])
    paths = [f"{name}={tmp_path / 'adapters' / name}" for name in engine]
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="sglang-lora", is_server=True)
    settings = {"rendezvous": f"127.0.0.1:{rendezvous.port}", "job_id": rendezvous.job_id, "engine_id": "server",
                "version": "v1", "lora": True}
    flags = ["--weight-version", "v1", "--disable-radix-cache", "--enable-lora", "--lora-paths", *paths, "--max-lora-rank", "8",
             "--lora-target-modules", *ALL_LINEAR, "--lora-backend", "torch_native", "--max-loras-per-batch", "3"]
    trainer = with_adapter("default", 41)
    with sglang_server(tmp_path, flags, {ENDPOINT_ENV: json.dumps(settings)}) as url:
        before = generate(url, "a")["output_ids"]
        assert_generated_by(served(engine["a"]), before)  # the adapter sglang loaded itself
        assert not generated_by(served(trainer), before), "pick seeds whose adapters answer differently"
        on_b: dict = {}

        def request_on_b() -> None:
            on_b["started"] = time.monotonic()
            on_b["answer"] = generate(url, "b", LONG)
            on_b["ended"] = time.monotonic()

        with Session(source=LoraSource(trainer), transport="mooncake", rendezvous=rendezvous, check=True) as session:
            session.connect(["server/a"])  # seconds, longer than the request: it must not span the connect
            runner = threading.Thread(target=request_on_b)
            runner.start()
            time.sleep(SETTLE)  # the request is running
            started = time.monotonic()
            report = session.update("a-1")
            ended = time.monotonic()
        assert report.ok and report.engines["server/a"].checked, report.format()
        assert_generated_by(served(trainer), generate(url, "a")["output_ids"])
        runner.join(600)
        assert on_b["started"] < started and on_b["ended"] > ended, "the request on b did not span the update"
        answer = on_b["answer"]
        assert answer["meta_info"]["finish_reason"]["type"] == "length", answer["meta_info"]
        assert_generated_by(served(engine["b"]), answer["output_ids"])
