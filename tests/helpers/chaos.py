"""The chaos schedule (#31): seeded random training steps and updates with faults.

Two FSDP2 trainer ranks (their own processes, a world of their own, restarted from the last
saved state when a rank is killed) take an AdamW step and update two bf16 torch engines
(processes of their own) per step, through one of four sessions drawn per step: delta on or
off, gather-free ("auto") or gathering. Faults drawn per step: an engine SIGKILLed (restarted
a few steps later), a trainer rank SIGKILLed mid-update, an engine's weights changed in place
behind the trainer's back, a second `update` from another thread mid-update, an engine
stopped (SIGSTOP) mid-update and continued once the update gave up on it, an engine stopped
as its finish is called (its writes landed) and continued after the report, a reconnect
while an engine is dead, and after an update a process of this host without the job's token
(`tests.helpers.intruder`) writing into and reading every range each serving engine published,
over its own Mooncake Transfer Engine, and calling every control route: all refused (drawn
from a generator of its own, so that the other faults' schedule per seed stays as it was). Every connect names every engine: the dead ones are left out. In a
box (`box`: the trainer ranks and the driver on node 0, each engine on a node of its own)
two network faults join them: an engine node's link pulled mid-update (mended after the
step) and an engine node's link losing 1 packet in 16 for a step. After every step an oracle
that does not call p2psync's sending code reads every live engine: torch's own full state
dict of the trainer, cast to bf16 by torch, of the version the engine says it serves.

The invariant: no engine ever serves bytes that are not exactly one acknowledged version's,
every engine the report calls ok serves this step's version, and one it calls stale does not
(once the calls it missed while stopped have landed). A failure names the seed and step.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from p2psync.core.control import post
from p2psync.core.errors import ControlError
from p2psync.core.rendezvous import Rendezvous
from p2psync.worlds import netbox
from p2psync.worlds.processes import context, process
from tests.helpers.engines import Place, engines, small_model, train_step, wait_for
from tests.helpers.intruder import attack_each
from tests.helpers.steps import after_step

ENGINES = ("a", "b")
DTYPE = "bfloat16"
TIMEOUT = 2.0  # transfer timeout: a stopped or cut-off engine is given up on after it
SESSIONS = [(delta, gather) for delta in (True, False) for gather in ("auto", "always")]
#: Per step, the chance of each fault.
FAULTS = {"kill_engine": 0.05, "kill_trainer": 0.03, "poke": 0.08, "concurrent": 0.05, "stall": 0.03,
          "late_finish": 0.04}
#: Per step, the chance of an intruder (drawn from a generator of its own).
INTRUDER = 0.06
#: The chance of a reconnect at a step while an engine is dead.
RECONNECT = 0.3
#: Per step, the chance of each network fault (in a box only).
NETWORK_FAULTS = {"cut": 0.05, "lossy": 0.08}
#: The share of packets a lossy link drops (percent).
LOSS_PERCENT = 6.25
#: A box for the schedule: node 0 holds the two trainer ranks and the driver, nodes 1 and 2 an
#: engine each.
BOX = netbox.Box((3, 1, 1), netbox.Link(gbit=1.0))
DRIVER = (0, 2)


def engine_node(engine: str) -> int:
    return 1 + ENGINES.index(engine)


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """torch's own full state dict of the trainer, float32 (collective over the world)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def as_engine_bytes(full: dict[str, torch.Tensor]) -> dict[str, str]:
    """What a full update leaves on a bf16 torch engine: torch's own cast, as hex."""
    return {n: t.to(torch.bfloat16).reshape(-1).view(torch.uint8).numpy().tobytes().hex() for n, t in full.items()}


def chaos_rank(rank: int, port: int, job_id: str, world: str, state: str, pipe: Any, place: Place | None) -> None:
    """A trainer rank of one world (at `place` in a box, where given): loads the last saved
    weights, then obeys `pipe`."""
    if place is not None:
        netbox.join(*place)
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from p2psync.adapters.fsdp2 import FSDP2Source
    from p2psync.core.errors import P2PSyncError
    from p2psync.core.logs import configure
    from p2psync.engine.client import EndpointControl
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
            left_out = {tuple(sorted(session.connect(args[0]).left_out)) for session in sessions.values()}
            pipe.send(("connected", *left_out))
            continue
        step, key, victim, concurrent, stall, cut, late = args
        train_step(model, optimizer, step)
        full = full_weights(model)
        oracle = as_engine_bytes(full) if rank == 0 else None
        if rank == 0:  # the state a restarted world resumes from
            torch.save(full, state + ".tmp")
            os.replace(state + ".tmp", state)
        session = sessions[tuple(key)]
        second: list[str] = []

        def fault() -> None:
            if victim == rank:
                os.kill(os.getpid(), signal.SIGKILL)
            if rank != 0:
                return
            if stall is not None:  # an engine stops mid-update (after its pause)
                os.kill(stall, signal.SIGSTOP)
            if cut is not None and place is not None:  # an engine node's link pulled mid-update
                netbox.cut(place[0], cut)
            if concurrent:
                thread = threading.Thread(target=lambda: second.append(_second_call(session, step)))
                thread.start()
                thread.join()

        finish = EndpointControl.finish
        stopped: list[str] = []

        def stop_first(control: EndpointControl, version: str) -> None:  # world rank 0 finishes the engines
            if late is not None and control.tables[0].engine_id == late[0]:
                os.kill(late[1], signal.SIGSTOP)
                stopped.append(late[0])
            finish(control, version)

        EndpointControl.finish = stop_first
        try:
            report = session.update(f"v{step}", progress=after_step(1, fault))
            outcome = {e: (r.ok, r.error) for e, r in report.engines.items()}
            pipe.send(("updated", outcome, report.degraded, oracle, second, stopped))
        except P2PSyncError as exc:
            pipe.send(("failed", f"{type(exc).__name__}: {exc}", oracle, second))
        finally:
            EndpointControl.finish = finish
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
    """The two trainer ranks of one world, driven through pipes (rank r at slot r of node 0 in
    a box, where given)."""

    def __init__(self, group: Any, number: int, state: Path, box: netbox.Box | None) -> None:
        ctx = context()
        self.pipes, self.procs = [], []
        for rank in range(2):
            mine, theirs = ctx.Pipe()
            place = (box, 0, rank) if box is not None else None
            args = (rank, group.rendezvous.port, group.rendezvous.job_id, f"world-{number}", str(state), theirs, place)
            proc = process(ctx, chaos_rank, args, daemon=True)
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


def _status(group: Any, engine: str) -> dict[str, Any]:
    """What engine `engine` says of itself (its `info`)."""
    return post(group.rendezvous.read_engine(engine)[0].control_url, "info", token=group.rendezvous.token(), timeout=10)


def serving(group: Any, engine: str) -> tuple[str | None, dict[str, str] | None]:
    """The version engine `engine` serves and its bytes, as it says (None: not serving)."""
    url = group.rendezvous.read_engine(engine)[0].control_url
    token = group.rendezvous.token()
    info = _status(group, engine)
    if not info["serving"]:
        return None, None
    try:
        return info["version"], post(url, "state", token=token, timeout=10)
    except ControlError:  # it stopped serving between the two calls (an update began)
        return None, None


def run_chaos(tmp_path: Path, *, steps: int, seed: int, box: netbox.Box | None = None) -> dict[str, int]:
    """Run `steps` seeded steps (in `box`, with its network faults, where given: this process
    must have joined the box at `DRIVER`); assert the invariant after each. Returns how often
    each fault and session was drawn, and (in a box) how many lossy steps still landed on the
    lossy engine (`lossy_landed`)."""
    rng = random.Random(seed)
    intruders = random.Random(f"intruder {seed}")
    tried: Counter[str] = Counter()
    faults_drawn = {**FAULTS, **(NETWORK_FAULTS if box is not None else {})}
    places = {e: (box, engine_node(e), 0) for e in ENGINES} if box is not None else None
    with engines(places=places) as group:
        for engine in ENGINES:
            start_engine(group, engine)
        alive, dead = set(ENGINES), {}  # dead: engine -> the step it restarts at
        worlds = 0
        world = World(group, worlds, tmp_path / "state.pt", box)
        assert world.ask("connect", ENGINES) == [("connected", ())] * 2
        acknowledged: dict[str, dict[str, str]] = {}  # version -> the oracle's bytes of it
        for step in range(steps):
            where = f"seed {seed} step {step}"
            restarted = sorted(e for e, at in dead.items() if at <= step)
            for engine in restarted:
                start_engine(group, engine)
                alive.add(engine)
                del dead[engine]
            reconnect = bool(dead) and rng.random() < RECONNECT
            if restarted or reconnect:
                tried["dead_at_connect"] += bool(dead)
                left_out = ("connected", tuple(sorted(dead)))  # every engine named, the dead ones left out
                assert world.ask("connect", ENGINES) == [left_out] * 2, where
            faults = {name for name, chance in faults_drawn.items() if rng.random() < chance}
            if len(alive) < 2:
                faults -= {"kill_engine", "stall", "cut", "late_finish"}
            stalled = cut = lossy = late = None
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
            if "cut" in faults:
                cut = rng.choice(sorted(alive - {stalled}))
            if "late_finish" in faults and alive - {stalled, cut}:
                late = rng.choice(sorted(alive - {stalled, cut}))
            if "lossy" in faults:
                lossy = rng.choice(sorted(alive))
                netbox.lose(box, engine_node(lossy), LOSS_PERCENT)
            key = rng.choice(SESSIONS)
            victim = rng.randrange(2) if "kill_trainer" in faults else None
            tried.update(faults)
            tried[f"delta={key[0]}, gather={key[1]}"] += 1
            print(f"chaos {where}: session delta={key[0]} gather={key[1]}, faults {sorted(faults)}, "
                  f"victim {victim}, stalled {stalled}, cut {cut}, lossy {lossy}, late {late}, dead {dead}", flush=True)
            answers = world.ask("step", step, key, victim, "concurrent" in faults,
                                group.pid(stalled) if stalled else None, engine_node(cut) if cut else None,
                                (late, group.pid(late)) if late else None)
            for engine in (stalled, late):
                if engine is not None:
                    group.thaw(engine)
            if box is not None:
                netbox.mend()
            if victim is not None:
                survivor = answers[1 - victim]
                assert answers[victim] is None and survivor is not None and survivor[0] == "failed", (where, answers)
                assert "TrainerLost" in survivor[1] and f"trainer rank {victim} was lost" in survivor[1], (where, survivor)
                world.end()
                worlds += 1
                world = World(group, worlds, tmp_path / "state.pt", box)
                assert world.ask("connect", ENGINES) == [("connected", tuple(sorted(dead)))] * 2, where
            else:
                assert all(a is not None and a[0] == "updated" for a in answers), (where, answers)
                _, outcome, degraded, oracle, second, stopped = answers[0]
                acknowledged[f"v{step}"] = oracle
                if "concurrent" in faults:
                    assert second == ["ConcurrentCallError"], (where, second)
                if stopped:  # stopped as its finish was called: stale, and once its calls landed, not serving
                    tried["late_finish_stopped"] += 1
                    assert not outcome[late][0], (where, late, "an engine stopped at its finish reported ok")
                    wait_for(lambda: _status(group, late)["stale"], 4 * TIMEOUT, f"{where}: {late} giving v{step} up")
                    assert not _status(group, late)["serving"], (where, late, "serves what the report calls stale")
                for engine, (ok, error) in outcome.items():
                    if engine in dead or engine in (stalled, cut):
                        assert not ok, (where, engine, "a killed, stopped or cut-off engine reported ok")
                    elif ok:
                        version, held = serving(group, engine)
                        assert version == f"v{step}", (where, engine, version, "reported ok")
                if lossy is not None and outcome.get(lossy, (False, None))[0]:
                    tried["lossy_landed"] += 1
            if intruders.random() < INTRUDER:
                tried["intruder"] += 1
                targets = [e for e in sorted(alive - {stalled}) if _status(group, e)["serving"]]
                rendezvous = group.rendezvous
                print(f"chaos {where}: an intruder without the token attacks serving engines {targets}", flush=True)
                attacks = attack_each(rendezvous.host, rendezvous.port, rendezvous.job_id, targets) if targets else {}
                for engine, got in attacks.items():
                    assert got.writes and got.routes, (where, engine, got)
                    refused = not (got.landed or got.read_back or got.leaked or got.answered)
                    assert refused, (where, engine, f"the intruder wrote at {got.landed}, read at {got.read_back}, "
                                     f"was answered by {got.answered}")
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
    print(f"chaos: seed {seed}, {steps} steps, faults and sessions drawn: {dict(sorted(tried.items()))}", flush=True)
    return dict(tried)
