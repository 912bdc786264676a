"""The chaos test (#31): a seeded random schedule of training steps and updates with faults.

Two FSDP2 trainer ranks (their own processes, a world of their own, restarted from the last
saved state when a rank is killed) take an AdamW step and update two bf16 torch engines
(processes of their own) per step, through one of four sessions drawn per step: delta on or
off, gather-free ("auto") or gathering. Faults drawn per step: an engine SIGKILLed (restarted
a few steps later), a trainer rank SIGKILLed mid-update, an engine's weights changed in place
behind the trainer's back, a second `update` from another thread mid-update, an engine
stopped (SIGSTOP) mid-update and continued once the update gave up on it. After every step an oracle that
does not call p2psync's sending code reads every live engine: torch's own full state dict of
the trainer, cast to bf16 by torch, of the version the engine says it serves.

The invariant: no engine ever serves bytes that are not exactly one acknowledged version's,
and every engine the report calls ok serves this step's version. `P2PSYNC_CHAOS_STEPS`
(default 100) and `P2PSYNC_CHAOS_SEED` (default a fixed one) choose the schedule; a failure
names the seed and step.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mooncake.engine", reason="Mooncake (p2psync[mooncake]) is not installed")

import torch  # noqa: E402
from tests.helpers.engines import engines, small_model, train_step, wait_for  # noqa: E402

from p2psync.core.control import post  # noqa: E402
from p2psync.core.errors import ControlError  # noqa: E402
from p2psync.core.rendezvous import Rendezvous  # noqa: E402

STEPS = int(os.environ.get("P2PSYNC_CHAOS_STEPS", "100"))
SEED = int(os.environ.get("P2PSYNC_CHAOS_SEED", "20261202"))
ENGINES = ("a", "b")
DTYPE = "bfloat16"
TIMEOUT = 2.0  # transfer timeout: a stopped engine is given up on after it
SESSIONS = [(delta, gather) for delta in (True, False) for gather in ("auto", "always")]
#: Per step, the chance of each fault.
FAULTS = {"kill_engine": 0.05, "kill_trainer": 0.03, "poke": 0.08, "concurrent": 0.05, "stall": 0.03}


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """torch's own full state dict of the trainer, float32 (collective over the world)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def as_engine_bytes(full: dict[str, torch.Tensor]) -> dict[str, str]:
    """What a full update leaves on a bf16 torch engine: torch's own cast, as hex."""
    return {n: t.to(torch.bfloat16).reshape(-1).view(torch.uint8).numpy().tobytes().hex() for n, t in full.items()}


def chaos_rank(rank: int, port: int, job_id: str, world: str, state: str, pipe: Any) -> None:
    """A trainer rank of one world: loads the last saved weights, then obeys `pipe`."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from p2psync.adapters.fsdp2 import FSDP2Source
    from p2psync.core.errors import P2PSyncError
    from p2psync.core.logs import configure
    from p2psync.trainer.session import Session

    configure(f"trainer {rank}")
    torch.set_num_threads(1)
    rendezvous = Rendezvous(host="127.0.0.1", port=port, job_id=job_id, timeout=30)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"{world}/", rendezvous._root), rank=rank, world_size=2)
    model = small_model(0)
    if Path(state).exists():
        model.load_state_dict(torch.load(state))
    for layer in model:
        fully_shard(layer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-5)
    sessions = {
        key: Session(source=FSDP2Source(model), rendezvous=rendezvous, transport="mooncake", delta=key[0],
                     gather=key[1], transfer_timeout=TIMEOUT, check=False)
        for key in SESSIONS
    }
    while True:
        command, *args = pipe.recv()
        if command == "quit":
            break
        if command == "connect":
            for session in sessions.values():
                session.connect(args[0])
            pipe.send(("connected",))
            continue
        step, key, victim, concurrent, stall = args
        train_step(model, optimizer, step)
        full = full_weights(model)
        oracle = as_engine_bytes(full) if rank == 0 else None
        if rank == 0:  # the state a restarted world resumes from
            torch.save(full, state + ".tmp")
            os.replace(state + ".tmp", state)
        session = sessions[tuple(key)]
        second: list[str] = []

        def progress(done: int, total: int) -> None:
            if done != 1:
                return
            if victim == rank:
                os.kill(os.getpid(), signal.SIGKILL)
            if stall is not None and rank == 0:  # an engine stops mid-update (after its pause)
                os.kill(stall, signal.SIGSTOP)
            if concurrent and rank == 0:
                thread = threading.Thread(target=lambda: second.append(_second_call(session, step)))
                thread.start()
                thread.join()

        try:
            report = session.update(f"v{step}", progress=progress)
            outcome = {e: (r.ok, r.error) for e, r in report.engines.items()}
            pipe.send(("updated", outcome, report.degraded, oracle, second))
        except P2PSyncError as exc:
            pipe.send(("failed", f"{type(exc).__name__}: {exc}", oracle, second))
    for session in sessions.values():
        session.close()
    pipe.send(("closed",))


def _second_call(session: Any, step: int) -> str:
    try:
        session.update(f"v{step}-again")
        return "no error"
    except Exception as exc:  # noqa: BLE001 - the test asserts which
        return type(exc).__name__


class World:
    """The two trainer ranks of one world, driven through pipes."""

    def __init__(self, group: Any, number: int, state: Path) -> None:
        ctx = mp.get_context("spawn")
        self.pipes, self.procs = [], []
        for rank in range(2):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=chaos_rank, args=(rank, group.rendezvous.port, group.rendezvous.job_id,
                                                        f"world-{number}", str(state), theirs), daemon=True)
            proc.start()
            self.pipes.append(mine)
            self.procs.append(proc)

    def ask(self, *command: Any, timeout: float = 120) -> list[Any]:
        """Each rank's answer (None for a rank that died without one)."""
        for pipe in self.pipes:
            pipe.send(command)
        answers = []
        for pipe, proc in zip(self.pipes, self.procs):
            deadline = time.monotonic() + timeout
            while not pipe.poll(0.1):
                if not proc.is_alive() or time.monotonic() > deadline:
                    break
            try:
                answers.append(pipe.recv() if pipe.poll(0) else None)
            except EOFError:  # it died: its end of the pipe closed
                answers.append(None)
        return answers

    def end(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.join(10)


def start_engine(group: Any, engine: str) -> None:
    before = group.rendezvous.read_engine(engine)[0].incarnation if engine in group.procs else -1
    group.start(engine, dtype=DTYPE)
    wait_for(lambda: group.rendezvous.read_engine(engine, timeout=180)[0].incarnation > before, 180,
             f"engine {engine}'s table")


def serving(group: Any, engine: str) -> tuple[str | None, dict[str, str] | None]:
    """The version engine `engine` serves and its bytes, as it says (None: not serving)."""
    url = group.rendezvous.read_engine(engine)[0].control_url
    token = group.rendezvous.token()
    info = post(url, "info", token=token, timeout=10)
    if not info["serving"]:
        return None, None
    try:
        return info["version"], post(url, "state", token=token, timeout=10)
    except ControlError:  # it stopped serving between the two calls (an update began)
        return None, None


def test_chaos_schedule_keeps_every_serving_engine_on_one_acknowledged_version(tmp_path):
    rng = random.Random(SEED)
    tried: Counter[str] = Counter()
    with engines() as group:
        for engine in ENGINES:
            start_engine(group, engine)
        alive, dead = set(ENGINES), {}  # dead: engine -> the step it restarts at
        worlds = 0
        world = World(group, worlds, tmp_path / "state.pt")
        assert world.ask("connect", sorted(alive)) == [("connected",)] * 2
        acknowledged: dict[str, dict[str, str]] = {}  # version -> the oracle's bytes of it
        for step in range(STEPS):
            where = f"seed {SEED} step {step}"
            restarted = sorted(e for e, at in dead.items() if at <= step)
            for engine in restarted:
                start_engine(group, engine)
                alive.add(engine)
                del dead[engine]
            if restarted:
                assert world.ask("connect", sorted(alive)) == [("connected",)] * 2, where
            faults = {name for name, chance in FAULTS.items() if rng.random() < chance}
            if len(alive) < 2:
                faults -= {"kill_engine", "stall"}
            stalled = None
            if "kill_engine" in faults:
                engine = rng.choice(sorted(alive))
                group.kill(engine)
                alive.remove(engine)
                dead[engine] = step + rng.randint(1, 3)
            if "poke" in faults:
                engine = rng.choice(sorted(alive))
                name = rng.choice(list(dict(small_model(0).named_parameters())))
                try:
                    post(group.rendezvous.read_engine(engine)[0].control_url, "poke",
                         {"name": name, "byte": rng.randrange(8)}, token=group.rendezvous.token(), timeout=10)
                except ControlError:  # not serving (stale since an earlier fault): nothing to change behind it
                    faults.discard("poke")
            if "stall" in faults:
                stalled = rng.choice(sorted(alive))
            key = rng.choice(SESSIONS)
            victim = rng.randrange(2) if "kill_trainer" in faults else None
            tried.update(faults)
            tried[f"delta={key[0]}, gather={key[1]}"] += 1
            print(f"chaos {where}: session delta={key[0]} gather={key[1]}, faults {sorted(faults)}, "
                  f"victim {victim}, stalled {stalled}, dead {dead}", flush=True)
            answers = world.ask("step", step, key, victim, "concurrent" in faults,
                                group.pid(stalled) if stalled else None)
            if stalled is not None:
                group.thaw(stalled)
            if victim is not None:
                survivor = answers[1 - victim]
                assert answers[victim] is None and survivor is not None and survivor[0] == "failed", (where, answers)
                assert "TrainerLost" in survivor[1] and f"trainer rank {victim} was lost" in survivor[1], (where, survivor)
                world.end()
                worlds += 1
                world = World(group, worlds, tmp_path / "state.pt")
                assert world.ask("connect", sorted(alive)) == [("connected",)] * 2, where
            else:
                assert all(a is not None and a[0] == "updated" for a in answers), (where, answers)
                _, outcome, degraded, oracle, second = answers[0]
                acknowledged[f"v{step}"] = oracle
                if "concurrent" in faults:
                    assert second == ["ConcurrentCallError"], (where, second)
                for engine, (ok, error) in outcome.items():
                    if engine in dead or engine == stalled:
                        assert not ok, (where, engine, "a killed or stopped engine reported ok")
                    elif ok:
                        version, held = serving(group, engine)
                        assert version == f"v{step}", (where, engine, version, "reported ok")
            for engine in sorted(alive):
                if engine == stalled:  # it may still be told or time out: not served either way
                    continue
                version, held = serving(group, engine)
                if version is None:
                    continue
                want = acknowledged.get(version)
                assert want is not None, (where, engine, f"serves {version!r}, which no report acknowledged")
                wrong = sorted(n for n in want if held.get(n) != want[n])
                assert not wrong, (where, engine, f"serves {version!r} with other bytes in {wrong}")
        world.ask("quit")
        world.end()
    print(f"chaos: seed {SEED}, {STEPS} steps, faults and sessions drawn: {dict(sorted(tried.items()))}")
