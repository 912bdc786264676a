"""Gather-free plus delta with two FSDP2 ranks (gloo) into a bfloat16 torch engine process
over Mooncake, through real AdamW steps: each rank sends only what changed of its own
shards' rows, both ranks patching the same engine rank. The oracle is torch's own full
state dict (`get_model_state_dict(full_state_dict=True)`) cast to the engine's dtype,
against the bytes the engine process holds after every update."""

from __future__ import annotations

import multiprocessing as mp

import pytest

pytest.importorskip("mooncake.engine", reason="Mooncake (p2psync[mooncake]) is not installed")

import torch  # noqa: E402
from tests.helpers.engines import engines, small_model, wait_for  # noqa: E402

from p2psync.worlds import free_port  # noqa: E402
from p2psync.worlds.processes import context, process  # noqa: E402

UPDATES = 3
LR = 3e-5  # small steps: most bfloat16 elements stay, so patches carry the rest


def _rank(rank: int, port: int, rendezvous_port: int, out: mp.Queue) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from p2psync.adapters.fsdp2 import FSDP2Source
    from p2psync.core.control import post
    from p2psync.core.layout import ALIGN
    from p2psync.core.rendezvous import Rendezvous
    from p2psync.trainer.session import Session

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = small_model(0)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    own_bytes = sum(p.to_local().numel() * 2 for p in model.parameters())  # its shards, as bfloat16
    rendezvous = Rendezvous(host="127.0.0.1", port=rendezvous_port, job_id="test")
    problems, reports = [], []
    with Session(
        source=FSDP2Source(model), rendezvous=rendezvous, transport="mooncake", delta=True, gather="auto",
        check=True, transfer_timeout=30.0,
    ) as session:
        session.connect(["a"])
        for step in range(UPDATES):
            generator = torch.Generator().manual_seed(1000 + step)
            tokens, labels = torch.randint(0, 64, (32,), generator=generator), torch.randint(0, 16, (32,), generator=generator)
            torch.nn.functional.cross_entropy(model(tokens), labels).backward()
            optimizer.step()
            optimizer.zero_grad()
            report = session.update(f"v{step}")
            oracle = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))  # collective
            if rank == 0:
                held = post(session.tables["a"][0].control_url, "state", token=session.token, timeout=30)
                want = {n: t.to(torch.bfloat16).reshape(-1).view(torch.uint8).numpy().tobytes().hex()
                        for n, t in oracle.items()}
                problems += [f"update {step}: {n} differs from torch's full state dict"
                             for n in want if held.get(n) != want[n]]
            reports.append((report.ok, report.engines["a"].delta_ranks, report.changed_elements,
                            report.compared_elements, report.engines["a"].bytes, report.degraded))
        stats = session.stats()
        params = sum(len(t.params) for t in session.tables["a"])
        memory = (stats.baseline_bytes, stats.patch_buffer_bytes, own_bytes, 2 * ALIGN * params)
    out.put((rank, problems, reports, memory))
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_fsdp2_ranks_send_deltas_of_their_own_shards_bit_exact():
    ctx = context()
    out = ctx.Queue()
    with engines() as group:
        group.start("a", dtype="bfloat16")
        wait_for(lambda: group.rendezvous.read_engine("a", timeout=180), 180, "engine a's table")
        port = free_port()
        procs = [process(ctx, _rank, (r, port, group.rendezvous.port, out)) for r in range(2)]
        for p in procs:
            p.start()
        results = {rank: rest for rank, *rest in (out.get(timeout=300) for _ in procs)}
        for p in procs:
            p.join(timeout=60)
    problems, reports, _ = results[0]
    assert problems == []
    full_bytes = reports[0][4]
    for step, (ok, delta_ranks, changed, compared, nbytes, degraded) in enumerate(reports):
        assert ok, (step, degraded)
        assert not any("sent in full" in n for n in degraded), (step, degraded)
        if step:
            assert delta_ranks == [0], step
            assert 0 < changed < compared / 2, (step, changed, compared)  # sparse: patches carried them
            assert nbytes < full_bytes / 2, (step, nbytes, full_bytes)
    for rank, (_, _, (baselines, patch_buffers, own, slack)) in results.items():
        # each rank's delta memory: its own shards' bytes (slots aligned) plus its patch buffers
        assert 0 < own <= baselines <= own + slack, (rank, baselines, own)
        assert patch_buffers > 0, rank
    assert sum(r[2][2] for r in results.values()) == sum(p.numel() * 2 for p in small_model(0).parameters())
