"""Do the engines hold the trainer's bytes? Digests of every parameter, trainer vs engine."""

from __future__ import annotations

from collections.abc import Sequence

from ..core.digest import byte_view, digest
from ..core.endpoint import EndpointControl
from ..core.rendezvous import Rendezvous
from ..core.source import TrainerSource
from ..core.types import Region


def mismatches(
    source: TrainerSource, buckets: Sequence[Sequence[str]], rendezvous: Rendezvous, engines: Sequence[str],
    *, is_caller: bool, timeout: float,
) -> list[str]:
    """Names (`engine/rank/param`) whose bytes differ from the trainer's full tensor.

    Collective over the trainer world (every rank gathers); only the rank with
    `is_caller` asks the engines and returns the answer, the others return [].
    """
    expected: dict[str, str] = {}
    for names in buckets:
        for name, tensor in source.gather(names).items():
            if is_caller:
                data = byte_view(tensor.contiguous())
                expected[name] = digest(data, [(0, len(data))])
    if not is_caller:
        return []
    token = rendezvous.token()
    wrong = []
    for engine in engines:
        tables = rendezvous.read_engine(engine)
        control = EndpointControl(tables, timeout=timeout, token=token)
        for table in tables:
            regions = {p.name: [Region(p.name, 0, 0, p.nbytes)] for p in table.params}
            held = control.digests(table.rank, regions)
            wrong += [f"{engine}/{table.rank}/{n}" for n, d in expected.items() if held.get(n) != d]
    return wrong
