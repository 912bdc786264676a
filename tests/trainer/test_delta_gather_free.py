"""Deltas on gather-free groups (in-process, toy engine of TP 2 over samehost): the trainer
rank keeps the baseline of exactly the bytes it packs from its own shards and sends only
what changed. The oracle is the toy engine's own loader fed the trainer's tensors
(`engine_rank`), byte for byte, after every update."""

from __future__ import annotations

import torch

from p2psync.core.layout import ALIGN
from tests.helpers.toy_engine import ShardSource, engine_rank, hf_model, toy_session


def tensors_of(seed: int) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in hf_model(seed).state_dict().items()}


def assert_own_load(engines, sources, step):
    for rank, engine in enumerate(engines):
        expected = engine_rank(len(engines), rank, sources)[1]
        for name, p in engine.named_parameters():
            assert torch.equal(p.data.view(torch.uint8), expected[name].view(torch.uint8)), (step, rank, name)


def poke(tensors: dict[str, torch.Tensor], step: int) -> None:
    """A sparse step: a few elements of every tensor change, at places that move each step."""
    for i, t in enumerate(tensors.values()):
        flat = t.view(-1)
        flat[(step * 7 + i) % flat.numel()] += 1.0
        flat[-1 - (step * 3 + i) % flat.numel()] -= 0.5


def test_gather_free_groups_get_patches_and_dense_writes_bit_exact():
    """Sparse steps, a step where every element changes, and steps whose values go back to
    older ones (which a stale baseline would take for unchanged)."""
    source = ShardSource(tensors_of(0))
    history: list[dict[str, torch.Tensor]] = []  # the tensors of each update
    with toy_session(source, delta=True, gather="auto") as (session, engines):
        stats = session.stats()
        free, gathered = stats.gather_free_bytes
        params = sum(len(t.params) for t in session.tables["toy-0"])
        reports = []
        for step in range(5):
            if step == 2:  # back to step 0's values, then a few more changes
                source.tensors.update({n: t.clone() for n, t in history[0].items()})
                poke(source.tensors, step)
            elif step == 3:  # every element changes: dense writes
                source.tensors.update(tensors_of(1))
            elif step == 4:  # back to step 2's values, densely
                source.tensors.update({n: t.clone() for n, t in history[2].items()})
            elif step:
                poke(source.tensors, step)
            history.append({n: t.clone() for n, t in source.tensors.items()})
            reports.append(session.update(f"v{step}"))
            assert reports[-1].ok, reports[-1].format()
            assert_own_load(engines, source.tensors, step)
        stats = session.stats()
    assert free > gathered > 0  # the loader computes the norms: they are gathered
    first, *later = reports
    assert first.engines["toy-0"].delta_ranks == []
    for step, report in enumerate(later, 1):
        assert report.engines["toy-0"].delta_ranks == [0, 1], (step, report.format())
        assert not any("sent in full" in n for n in report.degraded), (step, report.degraded)
        assert 0 < report.changed_elements < report.compared_elements, (step, report.format())
    assert all(r.engines["toy-0"].bytes * 4 < first.engines["toy-0"].bytes for r in later[:2]), [
        r.engines["toy-0"].bytes for r in reports]
    assert later[2].changed_elements > 0.8 * later[2].compared_elements  # all but the constants (padding)
    # The baselines are this rank's own bytes (here every shard) and the gathered groups', no more.
    assert free <= stats.baseline_bytes <= free + gathered + 2 * ALIGN * params, (stats, free, gathered)
    assert reports[-1].delta_memory_bytes == stats.delta_bytes


def test_gather_free_baselines_over_the_budget_are_sent_in_full_and_said():
    source = ShardSource(tensors_of(0))
    with toy_session(source, delta={"memory_bytes": 1}, gather="auto") as (session, engines):
        session.update("v0")
        poke(source.tensors, 1)
        report = session.update("v1")
        assert_own_load(engines, source.tensors, 1)
        assert session.stats().baseline_bytes == 0
    assert report.ok and report.engines["toy-0"].delta_ranks == []
    assert any("do not fit the baselines' memory budget" in n for n in report.degraded), report.degraded


def test_the_ranks_of_a_sender_group_patch_disjoint_shares_of_a_patch_area():
    """Gather-free, both ranks patch the same engine rank at once: their patch buffers must land
    in parts of its area that do not overlap, and the records must name where they landed."""
    from p2psync.core.delta import PatchRecord
    from p2psync.core.types import TargetParam, TargetTable
    from p2psync.trainer.delta_send import DeltaSender, StagedPatch
    from p2psync.trainer.options import DeltaOptions
    from p2psync.transports.samehost.transport import SameHostTransport

    area_at, area = 1 << 20, (1 << 20) + 4 * ALIGN
    table = TargetTable(
        engine_id="e", rank=0, world_size=1, engine="toy", layout_key={}, transport="samehost", transport_info={},
        control_url="", job_id="j", params=(TargetParam("w", (8,), "float32", 4096, 32),), patch_area=(area_at, area),
    )
    served = {"u": ([table], [])}
    transport = SameHostTransport()
    spans = []
    for share in [(0, 2), (1, 2)]:
        sender = DeltaSender(DeltaOptions(), device="cpu", pin_memory=False, acquire_timeout=1.0,
                             on_stall=lambda since: None)
        pool = sender.pool_for(served, share, None, transport)
        assert pool is not None
        sender.connect({"e": [table]}, served, share, pool)
        record = PatchRecord("w", 0, 4, 8, 1, "index", 0, 8)
        addr, records = sender.placed(StagedPatch("u", pool.acquire(1.0, lambda since: None), 16, [record]), table)
        assert records[0].meta_offset == addr - area_at and records[0].values_offset == addr - area_at + 8
        spans.append((addr, addr + pool.nbytes))
        sender.close()
        pool.close()
    (a0, a1), (b0, b1) = spans
    assert area_at <= a0 < a1 <= b0 < b1 <= area_at + area, spans
