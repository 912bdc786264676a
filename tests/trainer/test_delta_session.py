"""Delta updates end to end (tox env py): torch engines in their own processes, a trainer
taking real AdamW steps, `Session(delta=True)`. After every update each engine's bytes
must equal, bit for bit, what a full update writes: the trainer's tensors cast to
the engine's dtype by torch (`param.copy_`), read back from the engine process."""

from __future__ import annotations

import pytest

pytest.importorskip("mooncake.engine", reason="Mooncake (p2psync[mooncake]) is not installed")

import torch  # noqa: E402
from tests.helpers.engines import engines, small_model, train_step, wait_for  # noqa: E402
from tests.helpers.steps import after_step  # noqa: E402

from p2psync.adapters.fsdp2 import FSDP2Source  # noqa: E402
from p2psync.core.control import post  # noqa: E402
from p2psync.trainer.session import Session  # noqa: E402

LR = 3e-5
#: Seconds an engine process may take to publish its table: a loaded machine starts them slowly.
START_TIMEOUT = 180.0


def session_for(group, model, **kwargs) -> Session:
    kwargs.setdefault("transport", group.transport)
    kwargs.setdefault("transfer_timeout", 10.0)
    kwargs.setdefault("delta", True)
    return Session(source=FSDP2Source(model), rendezvous=group.rendezvous, **kwargs)


def start(group, engine: str, dtype: str) -> None:
    """Start an engine process and wait for its table (longer than connect waits). A killed
    engine's successor replaces the dead one's table as the next incarnation: wait for that
    one, which the trainer's next connect must see."""
    before = group.rendezvous.read_engine(engine)[0].incarnation if engine in group.procs else -1
    group.start(engine, dtype=dtype)
    wait_for(
        lambda: group.rendezvous.read_engine(engine, timeout=START_TIMEOUT)[0].incarnation > before,
        START_TIMEOUT, f"engine {engine}'s table",
    )


def held(session: Session, engine: str) -> dict[str, str]:
    """Every parameter's bytes as the engine process holds them (hex)."""
    table = session.tables[engine][0]
    return post(table.control_url, "state", token=session.token, timeout=10)


def full_bytes(model: torch.nn.Module, dtype: str) -> dict[str, str]:
    """What a full update leaves on a torch engine of `dtype`: the oracle."""
    return {
        name: p.detach().to(getattr(torch, dtype)).reshape(-1).view(torch.uint8).numpy().tobytes().hex()
        for name, p in model.named_parameters()
    }


def assert_bit_exact(session: Session, model: torch.nn.Module, dtypes: dict[str, str], step: int) -> None:
    for engine, dtype in dtypes.items():
        got, want = held(session, engine), full_bytes(model, dtype)
        wrong = sorted(name for name in want if got.get(name) != want[name])
        assert not wrong, f"update {step}: engine {engine} ({dtype}) differs from a full update in {wrong}"


def test_fifty_adamw_updates_stay_bit_exact_through_a_restart_and_two_layout_keys():
    """bf16 engines a and b share a layout key; c is fp8 (one-byte elements), another key.
    b is killed during update 25 and restarted: a full update, then deltas again. c is
    killed between updates 39 and 40 and restarted before the trainer notices: its new
    table alone must make update 40 a full one for it."""
    dtypes = {"a": "bfloat16", "b": "bfloat16", "c": "float8_e4m3fn"}
    with engines() as group:
        for engine, dtype in dtypes.items():
            start(group, engine, dtype)
        model = small_model(0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        full_size = sum(p.numel() * 2 for p in model.parameters())  # bytes of a bf16 engine's full update
        with session_for(group, model) as session:
            session.connect(list(dtypes))
            for step in range(50):
                train_step(model, optimizer, step)
                session.check = step % 2 == 1  # every other update also runs the digest check
                if step == 40:
                    group.kill("c")
                    start(group, "c", "float8_e4m3fn")
                    session.connect(list(dtypes))

                kill_b = after_step(1, lambda: group.kill("b")) if step == 25 else None
                report = session.update(f"v{step}", progress=kill_b)
                if step == 25:
                    assert report.stale == ["b"], report.format()
                    start(group, "b", "bfloat16")
                    session.connect(list(dtypes))
                else:
                    assert report.ok, report.format()
                live = {e: d for e, d in dtypes.items() if not (step == 25 and e == "b")}
                assert_bit_exact(session, model, live, step)

                delta = {e for e, r in report.engines.items() if r.delta_ranks == [0]}
                if step == 0:
                    assert delta == set()  # nothing held yet: full updates seed the baselines
                elif step == 26:
                    assert delta == {"a", "c"}, report.format()  # b restarted: full, and re-seeded
                elif step == 40:
                    assert delta == {"a", "b"}, report.format()  # c restarted: full
                else:
                    assert delta == set(dtypes), report.format()
                    assert report.engines["a"].bytes < full_size / 2, report.format()
                assert 0 < report.delta_memory_bytes


def test_full_every_full_true_and_a_failed_check_send_full_updates():
    with engines() as group:
        start(group, "a", "bfloat16")
        model = small_model(0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        # unproven baselines: the digest check is what catches the change (the proof: the next test)
        with session_for(group, model, delta={"full_every": 3, "prove_baselines": False}, check=True) as session:
            session.connect(["a"])
            modes = []
            for step in range(8):
                train_step(model, optimizer, step)
                if step == 4:
                    # the engine's bytes change behind the trainer's back: the delta check must catch it
                    name = next(iter(dict(model.named_parameters())))
                    post(session.tables["a"][0].control_url, "poke", {"name": name}, token=session.token, timeout=10)
                report = session.update(f"v{step}", full=step == 6)
                modes.append("delta" if report.engines["a"].delta_ranks else "full")
                if step == 4:
                    assert report.stale == ["a"] and "digest mismatch" in report.engines["a"].error
                    # told at once, not when its lease runs out: stale, naming the parameter, out of serving
                    info = wait_for(lambda: (i := post(session.tables["a"][0].control_url, "info",
                                                       token=session.token, timeout=10))["stale"] and i, 5, "stale")
                    assert info["stale"].startswith(f"update 'v4' given up by the trainer (was serving 'v3'): engine 'a' rank 0 "
                                                    f"parameter {name!r}: digest mismatch after write"), info
                    assert info["serving"] is False
                else:
                    assert report.ok, report.format()
                    assert_bit_exact(session, model, {"a": "bfloat16"}, step)
            # 0, 3, 6: full_every=3 and full=True; 5: after the failed check
            assert modes == ["full", "delta", "delta", "full", "delta", "full", "full", "delta"]


@pytest.mark.parametrize("change", ["poke", "reload"])
def test_an_engine_changed_outside_p2psync_gets_its_full_bytes_in_the_same_update(change):
    """After a full update and a delta, the engine's weights change behind the trainer's
    back, with check=False: a stray write (one byte of one parameter, which only the
    engine's fingerprints see) or a load_state_dict of the engine's module (which its
    endpoint sees). The next update proves the baseline first, sends that engine its full
    bytes, says so naming the parameter, and the engine holds exactly what a full update
    writes (the oracle: torch's own casts of the trainer's tensors); deltas resume after."""
    with engines() as group:
        start(group, "a", "bfloat16")
        model = small_model(0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        name = next(iter(dict(model.named_parameters())))
        with session_for(group, model, check=False) as session:
            session.connect(["a"])
            for step in range(4):
                train_step(model, optimizer, step)
                if step == 2:
                    post(session.tables["a"][0].control_url, change, {"name": name}, token=session.token, timeout=10)
                report = session.update(f"v{step}")
                assert report.ok, report.format()
                assert_bit_exact(session, model, {"a": "bfloat16"}, step)
                assert report.engines["a"].delta_ranks == ([] if step in (0, 2) else [0]), (step, report.format())
                if step == 2:
                    why = {"poke": f"1 parameter(s) changed since update 'v1' other than by p2psync: {name}",
                           "reload": "its weights were written outside p2psync (load_state_dict) after update 'v1'"}
                    assert report.degraded == [
                        f"delta: engine 'a' rank 0 was sent its full bytes, not a delta: {why[change]}"
                    ], report.degraded
                else:
                    assert report.degraded == [], report.degraded


def test_a_baseline_budget_too_small_sends_full_updates():
    with engines() as group:
        start(group, "a", "bfloat16")
        model = small_model(0)
        with session_for(group, model, delta={"memory_bytes": 1024}, check=True) as session:
            session.connect(["a"])
            for step in range(2):
                report = session.update(f"v{step}")
                assert report.ok and report.engines["a"].delta_ranks == []
            stats = session.stats()
            assert stats.delta_bytes == stats.patch_buffer_bytes  # no baseline held


@pytest.mark.parametrize("transport", ["samehost", "torchdist", "nixl"])
def test_delta_over_each_transport(transport):
    """Patches reach the engine's patch area over every transport (Mooncake: above)."""
    if transport == "nixl":
        pytest.importorskip("nixl_cu12", reason="NIXL (p2psync[nixl]) is not installed")
    with engines(transport=transport) as group:
        start(group, "a", "bfloat16")
        model = small_model(0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        with session_for(group, model, check=True) as session:
            session.connect(["a"])
            for step in range(3):
                train_step(model, optimizer, step)
                report = session.update(f"v{step}")
                assert report.ok, report.format()
                assert report.engines["a"].delta_ranks == ([0] if step else [])
                assert_bit_exact(session, model, {"a": "bfloat16"}, step)
