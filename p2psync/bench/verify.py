"""Do the engines hold the trainer's bytes? Digests of every parameter of every engine rank.

p2psync's own check (`Session(check=True)`) compares each rank's bytes with what its
layout produced from the trainer's tensors; after each way (engine parameters zeroed
first) every rank must hold exactly the bytes the engines' own loaders made of the
trainer's tensors (the reference way).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..engine.endpoint import EndpointControl
from ..core.rendezvous import Rendezvous
from ..core.types import Region


def held(rendezvous: Rendezvous, engines: Sequence[str], *, timeout: float) -> dict[str, str]:
    """Digest of every parameter each rank of `engines` holds, keyed `engine/rank/param`."""
    token = rendezvous.token()
    out = {}
    for engine in engines:
        tables = rendezvous.read_engine(engine)
        control = EndpointControl(tables, timeout=timeout, token=token)
        for table in tables:
            regions = {p.name: [Region(p.name, 0, 0, p.nbytes)] for p in table.params}
            out.update({f"{engine}/{table.rank}/{n}": d for n, d in control.digests(table.rank, regions).items()})
    return out
