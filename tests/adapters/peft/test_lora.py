"""LoRA adapter updates (PEFT) into a torch engine's adapter slots: only the adapter's tensors
move, each slot bit-exact with PEFT's own load of the trainer's adapter
(`set_peft_model_state_dict` on a model built as the engine's is), each slot with its own
version, the other slot untouched, and a slot whose settings differ refused at connect."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

peft = pytest.importorskip("peft", reason="PEFT (p2psync[lora]) is not installed")

import torch  # noqa: E402

from p2psync import ConnectError, Rendezvous, Session  # noqa: E402
from p2psync.adapters.peft import LoraSource  # noqa: E402
from p2psync.core.control import post  # noqa: E402
from p2psync.worlds.lora import adapter_bytes  # noqa: E402
from p2psync.worlds.processes import context, process  # noqa: E402
from tests.helpers.engines import RecordingTransport  # noqa: E402
from tests.helpers.matrix import TRANSPORTS, usable  # noqa: E402
from tests.helpers.peft_engine import (  # noqa: E402
    adapter_state, config_of, generate_with, lora_engine_process, with_adapters,
)

#: The engine's slots: "a" and "b" as the trainer's adapters are set, "wide" of another rank,
#: "loud" of another alpha.
SLOTS = {"a": {"seed": 11}, "b": {"seed": 12}, "wide": {"seed": 13, "r": 8}, "loud": {"seed": 14, "lora_alpha": 16}}
#: The trainer's two adapters (other random values than any slot holds).
TRAINER = {"default": {"seed": 21}, "other": {"seed": 22}}
CONTEXT = context()


def test_the_source_sends_exactly_the_adapters_tensors_under_peft_checkpoint_names():
    trainer = with_adapters(TRAINER)
    for adapter in TRAINER:
        source = LoraSource(trainer, adapter=adapter)
        expected = adapter_state(trainer, adapter)  # PEFT's own adapter checkpoint
        assert [s.name for s in source.param_specs()] == list(expected)
        gathered = source.gather(list(expected))
        assert all(torch.equal(gathered[n], t) for n, t in expected.items())
    assert source.config == {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "use_rslora": False,
                             "use_dora": False}
    with pytest.raises(ValueError, match=r"no LoRA adapter 'nope' \(its adapters: \['default', 'other'\]\)"):
        LoraSource(trainer, adapter="nope")


def test_an_adapter_slot_publishes_only_its_tensors_where_the_model_keeps_them():
    from p2psync.adapters.peft import serve_lora

    engine = with_adapters(SLOTS)
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="lora-slot", is_server=True, timeout=5)
    endpoint = serve_lora(engine, adapter="b", engine_id="lora/b", rendezvous=rendezvous, transport=RecordingTransport())
    try:
        expected = adapter_state(engine, "b")
        assert list(endpoint.params) == list(expected)
        held = {id(p.data.untyped_storage()): p for p in engine.parameters()}
        assert all(id(t.untyped_storage()) in held for t in endpoint.params.values())  # the model's own memory
        (table,) = rendezvous.read_engine("lora/b")
        assert table.extra["lora"] == {"adapter": "b", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
                                       "use_rslora": False, "use_dora": False}
    finally:
        endpoint.close()


@contextmanager
def lora_engine(transport: str, commands: Any = None, answers: Any = None) -> Iterator[Rendezvous]:
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="lora", is_server=True, timeout=60)
    stop = CONTEXT.Event()
    proc = process(CONTEXT, lora_engine_process, (rendezvous.port, "lora", transport, SLOTS, stop, commands, answers),
                   daemon=True)
    proc.start()
    try:
        for slot in SLOTS:
            rendezvous.read_engine(f"lora/{slot}")  # waits for the slot's table
        yield rendezvous
    finally:
        stop.set()
        proc.join(20)
        if proc.is_alive():
            proc.kill()


def call(rendezvous: Rendezvous, slot: str, route: str) -> dict:
    (table,) = rendezvous.read_engine(f"lora/{slot}")
    return post(table.control_url, route, token=rendezvous.token(), timeout=60)


def held_bytes(rendezvous: Rendezvous, slot: str) -> dict[str, str]:
    return call(rendezvous, slot, "state")


def step(model: torch.nn.Module, adapter: str, seed: int) -> None:
    """A change of the first quarter of the rows of each of `adapter`'s tensors (where every
    element changes, a delta moves as many bytes as a full update)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if f".{adapter}." in name:
                rows = p[: max(1, p.shape[0] // 4)]
                rows.add_(torch.randn(rows.shape, generator=generator) * 0.05)


@pytest.mark.parametrize("transport", [
    pytest.param(t, marks=pytest.mark.conformance(trainer="fsdp2", engine="torch", transport=t, via="peft lora"))
    for t in TRANSPORTS
])
def test_two_adapters_of_one_engine_are_updated_independently_bit_exact_with_peft_loading_them(transport):
    usable("transports", transport)
    trainer = with_adapters(TRAINER)
    reference = with_adapters(SLOTS)  # what PEFT's own load leaves in the engine's slots
    with lora_engine(transport) as rendezvous:
        with Session(source=LoraSource(trainer, adapter="default"), transport=transport, rendezvous=rendezvous,
                     check=True, delta=True) as into_a, \
             Session(source=LoraSource(trainer, adapter="other"), transport=transport, rendezvous=rendezvous,
                     check=True) as into_b:
            into_a.connect(["lora/a"])
            into_b.connect(["lora/b"])
            b_before = held_bytes(rendezvous, "b")
            for n, version in enumerate(("a-1", "a-2")):
                if n:
                    step(trainer, "default", seed=n)
                report = into_a.update(version)
                assert report.ok and report.engines["lora/a"].delta_ranks == ([0] if n else []), report.format()
                peft.set_peft_model_state_dict(reference, adapter_state(trainer, "default"), adapter_name="a")
                assert held_bytes(rendezvous, "a") == adapter_bytes(reference, "a")
                assert held_bytes(rendezvous, "b") == b_before  # the other slot untouched
                full = sum(t.nbytes for t in adapter_state(trainer, "default").values())  # the adapter, no base weight
                assert report.engines["lora/a"].bytes == full if n == 0 else 0 < report.engines["lora/a"].bytes < full
            assert call(rendezvous, "a", "generate")["tokens"] == generate_with(reference, "a")

            report = into_b.update("b-1")
            assert report.ok, report.format()
            peft.set_peft_model_state_dict(reference, adapter_state(trainer, "other"), adapter_name="b")
            assert held_bytes(rendezvous, "b") == adapter_bytes(reference, "b")
            assert held_bytes(rendezvous, "a") == adapter_bytes(reference, "a")
            assert call(rendezvous, "b", "generate")["tokens"] == generate_with(reference, "b")
            assert generate_with(reference, "a") != generate_with(reference, "b")
            assert (call(rendezvous, "a", "info")["version"], call(rendezvous, "b", "info")["version"]) == ("a-2", "b-1")


def test_a_slot_of_another_rank_or_alpha_is_refused_at_connect_naming_engine_rank_and_setting():
    trainer = with_adapters(TRAINER)
    with lora_engine("mooncake") as rendezvous:
        before = {slot: held_bytes(rendezvous, slot) for slot in ("wide", "loud")}
        for slot, setting in (("wide", "r 8 there, 4 here"), ("loud", "lora_alpha 16 there, 8 here")):
            with Session(source=LoraSource(trainer), transport="mooncake", rendezvous=rendezvous) as session:
                with pytest.raises(ConnectError) as error:
                    session.connect([f"lora/{slot}"])
            assert f"engine 'lora/{slot}' rank 0: its LoRA adapter slot '{slot}' does not match the trainer's " \
                   f"adapter 'default': {setting}" in str(error.value)
        assert {slot: held_bytes(rendezvous, slot) for slot in ("wide", "loud")} == before  # nothing written


def _fsdp2_rank(rank: int, port: int, rendezvous_port: int, out: mp.Queue) -> None:
    """One of two FSDP2 ranks of the trainer (its adapters sharded by `fully_shard`): a full
    update of adapter "default" into slot "a", then a delta after every adapter element is
    scaled by 1.5 (an exact step the test repeats on whole tensors)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = with_adapters(TRAINER)
    fully_shard(model)
    rendezvous = Rendezvous(host="127.0.0.1", port=rendezvous_port, job_id="lora")
    reports = []
    with Session(source=LoraSource(model), rendezvous=rendezvous, transport="mooncake", delta=True, check=True,
                 transfer_timeout=30.0) as session:
        session.connect(["lora/a"])
        reports.append(session.update("a-1"))
        held = [held_bytes(rendezvous, "a")] if rank == 0 else []
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".default." in name:
                    p.mul_(1.5)
        reports.append(session.update("a-2"))
        held += [held_bytes(rendezvous, "a")] if rank == 0 else []
    out.put((rank, [(r.ok, r.engines["lora/a"].delta_ranks, r.gather_free_bytes, r.gathered_bytes, r.format())
                    for r in reports], held))
    dist.destroy_process_group()


@pytest.mark.conformance(trainer="fsdp2", engine="torch", transport="mooncake", via="peft lora, 2 fsdp2 ranks")
def test_two_fsdp2_ranks_send_their_own_shards_of_an_adapter_then_deltas_bit_exact():
    from p2psync.worlds import free_port

    usable("transports", "mooncake")
    trainer, reference = with_adapters(TRAINER), with_adapters(SLOTS)
    wanted = []
    for _ in range(2):  # what PEFT's own load leaves in slot "a" after each update
        peft.set_peft_model_state_dict(reference, adapter_state(trainer, "default"), adapter_name="a")
        wanted.append(adapter_bytes(reference, "a"))
        with torch.no_grad():
            for name, p in trainer.named_parameters():
                if ".default." in name:
                    p.mul_(1.5)
    out = CONTEXT.Queue()
    with lora_engine("mooncake") as rendezvous:
        port = free_port()
        procs = [process(CONTEXT, _fsdp2_rank, (r, port, rendezvous.port, out)) for r in range(2)]
        for p in procs:
            p.start()
        results = dict((rank, (reports, held)) for rank, reports, held in (out.get(timeout=300) for _ in procs))
        for p in procs:
            p.join(30)
    for rank, (reports, _) in results.items():
        (ok1, delta1, free1, gathered1, text1), (ok2, delta2, _, _, text2) = reports
        assert ok1 and ok2, text1 + text2
        assert (delta1, delta2) == ([], [0]), text2
        assert free1 > 0 and gathered1 == 0, text1  # each rank sent its own rows, nothing gathered
    assert results[0][1] == wanted


def test_a_slot_loaded_while_the_engine_serves_is_updated_then_unloaded_and_refused():
    from p2psync.core.errors import RendezvousError

    usable("transports", "mooncake")
    trainer = with_adapters(TRAINER)
    reference = with_adapters(SLOTS)
    commands, answers = CONTEXT.Queue(), CONTEXT.Queue()
    with lora_engine("mooncake", commands, answers) as rendezvous:
        commands.put(("load", "new", {"seed": 15}))
        assert answers.get(timeout=60) == sorted([*SLOTS, "new"])
        assert call(rendezvous, "new", "info")["serving"] is False  # PEFT's initial weights: no version yet
        with Session(source=LoraSource(trainer), transport="mooncake", rendezvous=rendezvous, check=True) as session:
            session.connect(["lora/new"])
            assert session.update("new-1").ok
            reference.add_adapter("new", config_of({}))
            peft.set_peft_model_state_dict(reference, adapter_state(trainer, "default"), adapter_name="new")
            assert held_bytes(rendezvous, "new") == adapter_bytes(reference, "new")
            assert call(rendezvous, "new", "generate")["tokens"] == generate_with(reference, "new")
            commands.put(("unload", "new"))
            assert answers.get(timeout=60) == sorted(SLOTS)
            report = session.update("new-2")  # a trainer still connected is told what became of it
            assert report.engines["lora/new"].error == (
                "pause failed: its table was withdrawn (it shut down, or its LoRA slot was unloaded); connect "
                "again without it"
            ), report.format()
        with pytest.raises(RendezvousError, match="lora/new"):  # its table withdrawn: no trainer finds it
            rendezvous.read_engine("lora/new", timeout=2)
