"""The chaos schedule's layout cache faults (#46): seeded training steps and updates by a trainer
whose layouts live in a layout cache directory that other jobs share, into the toy engine's two
TP ranks (this process, same-host transport), which serve on across the trainer's restarts.

Per step the trainer changes about 1% of every tensor and, drawn per step:
- a poisoned entry: one rank's entry on disk rewritten well-formed under its own key but wrong
  (two blocks swapped, a block read a row off, a region past its parameter) or damaged (a byte
  flipped, truncated, another rank's entry renamed into place, another p2psync version's);
- a stale entry: another build of the engine adapter, which the key cannot tell apart from this
  one (its loader puts q's rows where k's go), runs a job of its own on the same directory and
  leaves its layouts there;
- a restart: a fresh trainer process (its layouts in memory dropped) connects again. A drawn
  fault always comes with one: an entry on disk is read by a process that starts.
Then it updates with `check=True`. The invariant after every step: the report is ok and checked,
and every engine rank holds exactly what the engine's own loader makes of this step's weights
(the oracle: `engine_rank`'s loader, never p2psync's layouts); a poisoned or stale entry is never
used (its layout compiled again instead). A failure names the seed and step.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
import torch

from p2psync.core.plugins import registry
from p2psync.core.rendezvous import Rendezvous
from p2psync.trainer import layouts
from p2psync.trainer.layouts import forget_layouts
from p2psync.trainer.session import Session
from tests.helpers.doubles import DictSource
from tests.helpers.toy_engine import ToyTarget, engine_rank, hf_model, serve_toy
from tests.layouts.test_add_an_engine import assert_own_load, state_of, touch_a_few
from tests.trainer.test_layout_disk import POISONS, WRONG, _other_rank_model, _OtherBuild, _rewrite, entries

TP = 2
#: Per step, the chance of each fault, and of a restart without one.
FAULTS = {"poisoned": 0.15, "stale": 0.1}
RESTART = 0.1


def run_cache_chaos(cache: Path, *, steps: int, seed: int) -> dict[str, int]:
    """Run `steps` seeded steps with the layout cache in `cache`; assert the invariant after
    each. Returns how often each fault, poison and restart was drawn."""
    rng = random.Random(seed)
    tried: Counter[str] = Counter()
    trainer = hf_model(seed)
    registry().add("engine_targets", ToyTarget, "tests", "0")
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="cache-chaos", is_server=True, timeout=10)
    engines = [engine_rank(TP, rank, {})[0] for rank in range(TP)]
    endpoints = [serve_toy(e, engine_id="toy-0", rendezvous=rendezvous, transport="samehost") for e in engines]
    session: Session | None = None
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(layouts, "adapter_build", lambda cls: "one build")  # the key cannot tell the builds apart
            for step in range(steps):
                where = f"cache chaos seed {seed} step {step}"
                touch_a_few(trainer, seed * 1000 + step)
                faults = {name for name, chance in FAULTS.items() if rng.random() < chance and session is not None}
                if "stale" in faults:
                    _another_build_runs_a_job(cache, rendezvous, patch)
                if "poisoned" in faults:
                    tried[_poison(cache, rng)] += 1
                restart = session is None or bool(faults) or rng.random() < RESTART
                tried.update(faults)
                if restart:
                    tried["restart"] += session is not None
                    if session is not None:
                        session.close()
                    forget_layouts()  # a fresh process has no layout in memory
                    session = Session(source=DictSource(state_of(trainer)), rendezvous=rendezvous,
                                      transport="samehost", check=True, layout_cache_dir=str(cache))
                    session.connect(["toy-0"])
                    counts = session.stats().layouts
                    assert counts.compiled + counts.disk == TP, (where, counts)
                    if faults:  # the entry the fault wrote is refused, not used
                        assert counts.compiled >= 1, (where, faults, counts)
                else:
                    session.source.tensors = state_of(trainer)
                report = session.update(f"v{step}")
                assert report.ok and all(e.checked for e in report.engines.values()), (where, report.format())
                assert_own_load(engines, state_of(trainer), where)
    finally:
        if session is not None:
            session.close()
        for endpoint in endpoints:
            endpoint.close()
        del registry().entries["engine_targets"]["toy"]
        forget_layouts()
    print(f"cache chaos: seed {seed}, {steps} steps, drawn: {dict(sorted(tried.items()))}", flush=True)
    return dict(tried)


def _poison(cache: Path, rng: random.Random) -> str:
    """One rank's entry poisoned by one of the ways drawn; the way's name."""
    paths = entries(cache)
    path = rng.choice(paths)
    ways = [(f"poison {f.__name__.strip('_')}", f) for f, _ in POISONS] + [
        (f"wrong {f.__name__.strip('_')}", f) for f, _ in WRONG
    ]
    name, way = rng.choice(ways)
    if name.startswith("poison"):
        other = next(p for p in paths if p != path)
        path.write_bytes(way(path.read_bytes(), other.read_bytes()))
    else:
        _rewrite(path, way)
    return name


def _another_build_runs_a_job(cache: Path, rendezvous: Rendezvous, patch: pytest.MonkeyPatch) -> None:
    """Another build of the engine adapter (q and k swapped by its loader) connects and updates
    engines of its own from a process of its own, on the same cache directory: the entries it
    finds there fail its check and it leaves its own."""
    forget_layouts()
    with patch.context() as other:
        other.setattr(ToyTarget, "rank_model", _other_rank_model)
        theirs = [engine_rank(TP, rank, {}, model=_OtherBuild)[0] for rank in range(TP)]
        served = [serve_toy(e, engine_id="toy-other", rendezvous=rendezvous, transport="samehost") for e in theirs]
        try:
            weights = state_of(hf_model(7))
            with Session(source=DictSource(weights), rendezvous=rendezvous, transport="samehost", check=True,
                         layout_cache_dir=str(cache)) as session:
                session.connect(["toy-other"])
                assert session.update("theirs").ok
            for rank, engine in enumerate(theirs):  # its engines too hold what their own loader makes
                expected = engine_rank(TP, rank, weights, model=_OtherBuild)[1]
                wrong = [n for n, p in engine.named_parameters() if not torch.equal(p.data, expected[n])]
                assert not wrong, f"another build's engine rank {rank} holds other bytes than its loader's in {wrong}"
        finally:
            for endpoint in served:
                endpoint.close()
    forget_layouts()  # that process's memory is not this one's
