"""A real single-rank sglang server on CPU, updated from a trainer over Mooncake (environment
conformance-sglang).

The server loads one random model; the trainer holds another. After one update,
every token of a greedy generation through the server's HTTP API is transformers'
greedy choice with the trainer's weights (within bfloat16's reach of a tie), and the server reports the new weight version. p2psync's
plugin reaches every server process through sglang's own plugin entry points.
A trainer killed mid-update leaves the server paused and its endpoint stale, until
the next trainer world updates it.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from p2psync.adapters.fsdp2 import FSDP2Source
from p2psync.adapters.sglang import VersionSpan, version_spans
from p2psync.adapters.sglang.server import publish_server
from p2psync.core.control import http_json
from p2psync.adapters.sglang.server_plugin import ENDPOINT_ENV
from p2psync.worlds import PROMPT, TINY_QWEN3, ModelSpec, free_port, greedy, greedy_gaps
from p2psync.core.control import post
from p2psync.core.errors import ConnectError, ControlError
from p2psync.core.rendezvous import Rendezvous
from p2psync.integrations.miles import record_weight_versions
from p2psync.trainer.session import Session
from tests.helpers.matrix import usable

STARTUP_TIMEOUT = 420
#: The model both sides build: the worlds' tiny Qwen3 with a vocabulary of 256.
MODEL = ModelSpec(config={**TINY_QWEN3, "vocab_size": 256})
#: How far below the best logit a token the server chose may fall under the weights it should
#: hold. sglang computes in bfloat16: its logits differ from transformers' float32 ones on the
#: same (bfloat16) weights by up to 0.025 on these models, and near-ties (gaps under 0.01 between
#: the two best tokens occur) then go either way; tokens another model chose fall 0.1 to 2 below.
MARGIN = 0.05


def served(model: torch.nn.Module) -> torch.nn.Module:
    """A float32 copy of `model` holding the bfloat16-rounded weights the server holds."""
    return copy.deepcopy(model).to(torch.bfloat16).float()


def generated_by(model: torch.nn.Module, tokens: list[int], prompt: list[int] = PROMPT) -> bool:
    """Whether every one of `tokens` is `model`'s greedy choice, within MARGIN."""
    return max(greedy_gaps(model, tokens, prompt)) <= MARGIN


def assert_generated_by(model: torch.nn.Module, tokens: list[int], prompt: list[int] = PROMPT) -> None:
    gaps = greedy_gaps(model, tokens, prompt)
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    assert gaps[worst] <= MARGIN, (
        f"token {worst} ({tokens[worst]}) falls {gaps[worst]:.3f} below the best logit of the weights the"
        f" server should hold (margin {MARGIN}); every gap: {[round(g, 3) for g in gaps]}"
    )


@pytest.fixture(scope="module", autouse=True)
def _sglang_installed() -> None:  # module-wide: before the shared server's fixture
    usable("engine_targets", "sglang")
    usable("transports", "mooncake")


def plugin_dir(root: Path) -> Path:
    """A distribution that declares p2psync's sglang general plugin, for sglang to discover."""
    info = root / "p2psync_sglang_plugin-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: p2psync-sglang-plugin\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[sglang.srt.plugins]\np2psync = p2psync.adapters.sglang.server_plugin:load\n")
    return root


@contextmanager
def sglang_server(
    tmp_path: Path, flags: list[str], env: dict[str, str], ready: str = "/health_generate"
) -> Iterator[str]:
    """A real sglang server on CPU holding the seed-1 model, with p2psync's plugin installed; its
    URL once `ready` answers."""
    model = MODEL.build(seed=1)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "model")
    port = free_port()
    env = {
        **os.environ,
        **env,
        "PYTHONPATH": os.pathsep.join([str(plugin_dir(tmp_path / "plugins")), os.environ.get("PYTHONPATH", "")]),
        "SGLANG_HOST_IP": "127.0.0.1",
        "MOONCAKE_PROTOCOL": "tcp",
    }
    command = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", str(tmp_path / "model"), "--dtype", "bfloat16",
        "--device", "cpu", "--attention-backend", "torch_native", "--skip-tokenizer-init",
        "--engine-info-bootstrap-port", str(free_port()), "--mem-fraction-static", "0.2", "--max-total-tokens", "4096",
        "--context-length", "256", "--host", "127.0.0.1", "--port", str(port), *flags,
    ]
    log = open(tmp_path / "server.log", "w")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            if process.poll() is not None:
                pytest.fail(f"sglang server exited with {process.returncode}:\n{(tmp_path / 'server.log').read_text()[-3000:]}")
            try:
                http_json(url, ready, timeout=10)
                break
            except ControlError:
                if time.monotonic() > deadline:
                    pytest.fail(f"sglang server not ready in {STARTUP_TIMEOUT} s")
                time.sleep(2)
        yield url
    finally:
        os.killpg(process.pid, 15)
        process.wait(timeout=60)
        log.close()


def generate(url: str) -> dict:
    body = {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
    return http_json(url, "/generate", body, timeout=120)


def update_and_check(
    url: str, trainer: torch.nn.Module, rendezvous: Rendezvous, *, check: bool, version: str = "v2"
) -> None:
    """One update of engine "server" from `trainer`; then the server generates like it, at `version`."""
    expected = served(trainer)
    assert not generated_by(expected, generate(url)["output_ids"]), "pick seeds whose models answer differently"
    with Session(source=FSDP2Source(trainer), transport="mooncake", rendezvous=rendezvous, check=check) as session:
        session.connect(["server"])
        report = session.update(version)
        assert report.ok, report.format()
        assert report.engines["server"].checked == check
        assert report.engines["server"].bytes == sum(p.nbytes for p in session.tables["server"][0].params)
    answer = generate(url)
    assert_generated_by(expected, answer["output_ids"])
    assert answer["meta_info"]["weight_version"] == version


def trainer_model() -> tuple[torch.nn.Module, dict]:
    return MODEL.build(seed=2), MODEL.config_dict()


@dataclass(frozen=True)
class PluginServer:
    """A server with p2psync's plugin, shared by the tests below (a start takes most of a minute
    on CPU); each test first puts weights it knows in place (`reset`) under labels of its own, as
    no two tests may name different weights alike."""

    url: str
    rendezvous: Rendezvous

    def reset(self, model: torch.nn.Module, version: str) -> None:
        """A full, checked update to `model`'s weights as `version` (a new session's first update
        is full), so the test starts from them whatever ran before it."""
        with Session(source=FSDP2Source(model), transport="mooncake", rendezvous=self.rendezvous,
                     check=True) as session:
            session.connect(["server"])
            report = session.update(version)
            assert report.ok and report.engines["server"].checked, report.format()


@pytest.fixture(scope="module")
def plugin_server(tmp_path_factory) -> Iterator[PluginServer]:
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="sglang-plugin", is_server=True)
    settings = {
        "rendezvous": f"127.0.0.1:{rendezvous.port}", "job_id": rendezvous.job_id, "engine_id": "server",
        "version": "v1",
    }
    flags = ["--weight-version", "v1"]  # sglang's own name for what it loaded, as the plugin declares
    with sglang_server(tmp_path_factory.mktemp("plugin-server"), flags, {ENDPOINT_ENV: json.dumps(settings)}) as url:
        yield PluginServer(url, rendezvous)


@pytest.mark.slow
@pytest.mark.conformance(trainer="fsdp2", engine="sglang", transport="mooncake", via="sglang server endpoint")
def test_server_with_its_own_transfer_engine_endpoint_is_updated(tmp_path):
    """Targets and control from the server's own API (`publish_server`, `ServerControl`)."""
    trainer, hf_config = trainer_model()
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="sglang-server", is_server=True)
    with sglang_server(tmp_path, ["--remote-instance-weight-loader-start-seed-via-transfer-engine"], {}) as url:
        publish_server(url, engine_id="server", rendezvous=rendezvous, hf_config=hf_config, version="v1")
        assert generate(url)["meta_info"]["weight_version"] == "v1"  # the declared version, named on the server
        with Session(source=FSDP2Source(trainer), transport="mooncake", rendezvous=rendezvous, check=True) as session:
            with pytest.raises(ConnectError, match="check=True: engine 'server': .*serve it with p2psync's sglang plugin"):
                session.connect(["server"])  # its digests cannot be asked for: refused before anything is written
        assert generate(url)["meta_info"]["weight_version"] == "v1"  # untouched, still serving
        update_and_check(url, trainer, rendezvous, check=False)


#: A trainer process that starts an update of engine "server" and is killed (SIGKILL) after
#: its third bucket, its writes partly landed.
KILLED_TRAINER = """
import os, signal, sys
from p2psync.adapters.fsdp2 import FSDP2Source
from p2psync.core.rendezvous import Rendezvous
from p2psync.integrations.miles import record_weight_versions
from p2psync.trainer.session import Session
from p2psync.worlds import TINY_QWEN3, ModelSpec
from tests.helpers.steps import after_step

port, lease = int(sys.argv[1]), float(sys.argv[2])
trainer = ModelSpec(config={**TINY_QWEN3, "vocab_size": 256}).build(seed=2)
rendezvous = Rendezvous(host="127.0.0.1", port=port, job_id="sglang-fault")
session = Session(source=FSDP2Source(trainer), transport="mooncake", rendezvous=rendezvous, bucket_bytes=1,
                  transfer_timeout=10, update_lease=lease, gather="always")  # killed between gathered buckets
session.connect(["server"])

def die():
    print("killed after 3 buckets", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

session.update("v1", progress=after_step(3, die))
"""


def generates_within(url: str, seconds: float) -> bool:
    try:
        body = {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
        http_json(url, "/generate", body, timeout=seconds)
        return True
    except ControlError:
        return False


@pytest.mark.slow
@pytest.mark.conformance(trainer="fsdp2", engine="sglang", transport="mooncake", via="sglang server plugin")
def test_a_trainer_killed_mid_update_leaves_the_server_paused_until_the_next_trainer_updates_it(tmp_path):
    lease = 8.0
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="sglang-fault", is_server=True, timeout=300)
    settings = {"rendezvous": f"127.0.0.1:{rendezvous.port}", "job_id": rendezvous.job_id, "engine_id": "server"}
    env = {ENDPOINT_ENV: json.dumps(settings), "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}
    with sglang_server(tmp_path, [], env, ready="/health") as url:
        table = rendezvous.read_engine("server")[0]

        def status() -> dict:
            return post(table.control_url, "info", token=rendezvous.token(), timeout=30)

        # Weights of no known version: out of serving until the first update.
        assert (status()["version"], status()["serving"]) == (None, False)
        assert not generates_within(url, 5)

        killed = subprocess.run(
            [sys.executable, "-c", KILLED_TRAINER, str(rendezvous.port), str(lease)],
            capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        assert killed.returncode == -9 and "killed after 3 buckets" in killed.stdout, killed.stdout + killed.stderr[-3000:]

        deadline = time.monotonic() + lease + 60
        while status()["stale"] is None:
            assert time.monotonic() < deadline, f"no stale mark: {status()}"
            time.sleep(1)
        stale = status()
        assert stale["stale"].startswith("update abandoned at version 'v1' (was serving None): no finish within 8 s")
        assert (stale["updating"], stale["serving"]) == ("v1", False)
        assert not generates_within(url, 5)  # paused: never resumed with mixed weights

        trainer = MODEL.build(seed=3)  # the next trainer world
        assert greedy(trainer) not in (greedy(MODEL.build(seed=1)), greedy(MODEL.build(seed=2)))
        with Session(source=FSDP2Source(trainer), transport="mooncake", rendezvous=rendezvous, check=True) as session:
            session.connect(["server"])
            report = session.update("v2")
            assert report.ok and report.engines["server"].checked, report.format()
        answer = generate(url)
        assert_generated_by(served(trainer), answer["output_ids"])
        assert answer["meta_info"]["weight_version"] == "v2"
        assert (status()["version"], status()["serving"], status()["stale"]) == ("v2", True, None)


@pytest.mark.slow
@pytest.mark.conformance(trainer="fsdp2", engine="sglang", transport="mooncake", via="sglang server plugin")
def test_server_with_p2psync_endpoint_from_the_plugin_is_updated_and_checked(plugin_server):
    """The plugin serves p2psync's endpoint in the scheduler and publishes its table; digests are checked."""
    trainer, _ = trainer_model()
    plugin_server.reset(MODEL.build(seed=1), "plugin-1")
    update_and_check(plugin_server.url, trainer, plugin_server.rendezvous, check=True, version="plugin-2")


#: New tokens of the request in flight across each update; the update starts once it has some.
#: The update pauses the server 2-5 tokens later here; with 24 a slower machine once finished the
#: request before the pause came.
IN_FLIGHT_TOKENS, UPDATE_AFTER = 96, 6


def generate_across_update(url: str, update: Callable[[], None]) -> dict:
    """Stream a greedy generation of `IN_FLIGHT_TOKENS` from the server, run `update()` once it has
    produced `UPDATE_AFTER` tokens, and return the last chunk (its output_ids and meta_info)."""
    body = {
        "input_ids": PROMPT, "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": IN_FLIGHT_TOKENS, "ignore_eos": True},
    }
    started = threading.Event()
    chunks: list[dict] = []

    def read() -> None:
        request = urllib.request.Request(f"{url}/generate", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as answer:
            for line in answer:
                data = line.strip().removeprefix(b"data:").strip()
                if not data or data == b"[DONE]":
                    continue
                chunks.append(json.loads(data))
                if len(chunks[-1].get("output_ids", [])) >= UPDATE_AFTER:
                    started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert started.wait(120), f"the request produced no {UPDATE_AFTER} tokens: {chunks[-1:]}"
    update()
    reader.join(300)
    assert not reader.is_alive() and chunks, "the request in flight never ended"
    return chunks[-1]


@pytest.mark.slow
@pytest.mark.conformance(trainer="fsdp2", engine="sglang", transport="mooncake", via="sglang server pause modes")
def test_requests_in_flight_across_updates_complete_in_retract_and_in_place_and_abort_when_asked(plugin_server):
    """A greedy generation is in flight as each update starts. Retract (the default): it completes,
    its tokens before the update are the old weights' greedy choices, those after it the new
    weights' choices continuing the prompt and the tokens so far (sglang recomputes their KV), and its
    version spans name both versions. In place: it completes, continuing on its old KV (its
    tokens before are the old weights'). Abort: it ends with sglang's abort reason. Each update
    checked (digests through the plugin's endpoint)."""
    trainer = MODEL.build(seed=1)
    plugin_server.reset(trainer, "modes-1")
    url, rendezvous = plugin_server.url, plugin_server.rendezvous
    with Session(source=FSDP2Source(trainer), transport="mooncake", rendezvous=rendezvous, check=True) as session:
        session.connect(["server"])
        for old, new, mode in (("modes-1", "modes-2", None), ("modes-2", "modes-3", "in_place"),
                               ("modes-3", "modes-4", "abort")):
            before = served(trainer)
            with torch.no_grad():  # the next step's weights
                trainer.load_state_dict(MODEL.build(seed=int(new.removeprefix("modes-"))).state_dict())
            reports = []
            last = generate_across_update(url, lambda: reports.append(session.update(new, pause=mode)))
            (report,) = reports
            assert report.ok and report.engines["server"].checked, report.format()
            assert report.engines["server"].pause == (mode or "retract")
            out, meta = last["output_ids"], last["meta_info"]
            if mode == "abort":
                assert meta["finish_reason"]["type"] == "abort", meta
                assert len(out) < IN_FLIGHT_TOKENS
                continue
            assert meta["finish_reason"]["type"] != "abort" and len(out) == IN_FLIGHT_TOKENS, meta
            spans = version_spans(meta)
            assert [s.version for s in spans] == [old, new] and spans[0].start == 0, (
                f"the request in flight should span {old} and {new}: {spans}"
            )
            cut = spans[0].end
            sample = SimpleNamespace(weight_versions=[], metadata={})  # a miles/slime rollout record
            record_weight_versions(sample, meta)
            assert sample.weight_versions == [old, new]
            assert spans[1] == VersionSpan(new, cut, IN_FLIGHT_TOKENS) and UPDATE_AFTER <= cut < IN_FLIGHT_TOKENS
            assert_generated_by(before, out[:cut])  # the old weights' tokens, none lost
            if mode is None:  # retracted: the rest recomputed with the new weights
                after, so_far = served(trainer), [*PROMPT, *out[:cut]]
                assert_generated_by(after, out[cut:], so_far)
                assert not generated_by(before, out[cut:], so_far), "the old weights choose these tokens too"
    answer = generate(url)  # after the abort: serving the last update's weights
    assert answer["meta_info"]["weight_version"] == "modes-4"
    assert_generated_by(served(trainer), answer["output_ids"])


#: The weight the server reloads from disk behind p2psync's back (one sglang parameter, one HF tensor).
TAMPERED = "model.layers.1.mlp.down_proj.weight"


def tamper(url: str, model: torch.nn.Module, path: Path) -> None:
    """Have the server load, through sglang's own `/update_weights_from_disk`, a checkpoint of
    what it holds (`model`'s weights) with TAMPERED changed: a write p2psync never saw."""
    changed = copy.deepcopy(model).to(torch.bfloat16)
    with torch.no_grad():
        changed.get_parameter(TAMPERED).add_(1.0)
    changed.save_pretrained(path)
    answer = http_json(url, "/update_weights_from_disk", {"model_path": str(path)}, timeout=300)
    assert answer["success"], answer


@pytest.mark.slow
@pytest.mark.conformance(trainer="fsdp2", engine="sglang", transport="mooncake", via="sglang server check")
def test_bytes_changed_on_the_server_behind_p2psyncs_back_fail_the_check_naming_the_parameter(plugin_server, tmp_path):
    """check=True against a real server, through the plugin's endpoint. After a full update, the
    server reloads one weight from disk, changed. A delta update that trusts its baselines
    (`prove_baselines=False`) does not rewrite it: the check fails, naming that parameter, and
    the server is not resumed. With baselines proven (the default), the next update finds the
    change, sends the rank its full bytes and lands exact."""
    trainer = MODEL.build(seed=2)
    url, rendezvous = plugin_server.url, plugin_server.rendezvous  # the first update is full: from any weights

    def step() -> None:  # the next weights differ in one other tensor: each delta has something to send
        with torch.no_grad():
            trainer.get_parameter("model.layers.0.mlp.up_proj.weight").mul_(1.5)

    trusting = Session(source=FSDP2Source(trainer), transport="mooncake", rendezvous=rendezvous, check=True,
                       delta={"prove_baselines": False})
    with trusting as session:
        session.connect(["server"])
        assert session.update("check-2").ok
        tamper(url, trainer, tmp_path / "tampered-1")
        step()
        report = session.update("check-3")
    (engine,) = report.engines.values()
    assert not report.ok and engine.delta_ranks == [0], report.format()
    assert "digest mismatch" in engine.error and f"parameter '{TAMPERED}'" in engine.error, engine.error
    assert "up_proj" not in engine.error, engine.error  # what the delta sent landed
    assert not generates_within(url, 5)  # not resumed with weights the check refused

    with Session(source=FSDP2Source(trainer), transport="mooncake", rendezvous=rendezvous, check=True,
                 delta=True) as session:
        session.connect(["server"])
        assert session.update("check-4").ok  # full: a new session holds no baselines
        tamper(url, trainer, tmp_path / "tampered-2")
        step()
        report = session.update("check-5")
    (engine,) = report.engines.values()
    assert report.ok and engine.checked and engine.delta_ranks == [], report.format()
    assert any("full bytes" in note and TAMPERED in note for note in report.degraded), report.degraded
    assert_generated_by(served(trainer), generate(url)["output_ids"])
