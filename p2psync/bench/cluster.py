"""The bench in a cluster in a box (`p2psync.worlds.netbox`): trainer and engine ranks as
emulated nodes whose links between nodes are shaped as a cluster's, inside node unshaped (as
NVLink would be).

A topology names the trainer ranks of each trainer node and the engines (count x TP ranks),
each engine on a node of its own; `a`, `b` and `c` are the three kept ones. The bench's
launcher enters a network namespace of its own and shapes it; every bench process joins its
node first thing (`join`), so that every socket it opens (rendezvous, gloo, the transport,
the HTTP control routes) leaves from its node's address. `nic_bytes` reads what each NIC
sent, and `measure_link` the rate one NIC really carries between two nodes.
"""

from __future__ import annotations

import re
import socket
import time
from dataclasses import dataclass
from typing import Any, Literal

from ..worlds import netbox

#: The kept topologies: (a) 4 trainer ranks on one node -> 1 engine of TP 4 on its node; (b) the
#: same trainers -> 2 engines of TP 2, each on its node; (c) trainer ranks over two nodes (their
#: gathers cross the link) -> 2 engines of TP 2.
PRESETS = {"a": "4:1x4", "b": "4:2x2", "c": "2,2:2x2"}
_SPEC = re.compile(r"^(\d+(?:,\d+)*):(\d+)x(\d+)$")


@dataclass(frozen=True)
class Topology:
    """Trainer ranks per trainer node (`trainer_nodes`), then `engines` engines of `tp` ranks
    each on a node of its own; every NIC (one per rank, or one per node) on `link`."""

    name: str
    trainer_nodes: tuple[int, ...]
    engines: int
    tp: int
    link: netbox.Link
    nic: Literal["rank", "node"] = "rank"

    @classmethod
    def parse(cls, spec: str, link: netbox.Link, nic: Literal["rank", "node"] = "rank") -> Topology:
        """`a`, `b`, `c` or `TRAINERS[,TRAINERS...]:ENGINESxTP` (e.g. `2,2:2x2`: two trainer
        nodes of 2 ranks, 2 engines of TP 2)."""
        match = _SPEC.match(PRESETS.get(spec, spec))
        if match is None:
            raise ValueError(
                f"a cluster topology is one of {sorted(PRESETS)} or TRAINERS[,TRAINERS...]:ENGINESxTP "
                f"(e.g. 2,2:2x2), got {spec!r}"
            )
        trainers, engines, tp = match.groups()
        topology = cls(spec, tuple(int(n) for n in trainers.split(",")), int(engines), int(tp), link, nic)
        topology.box()  # refuses node and rank counts a box cannot hold
        if topology.engines < 1 or topology.tp < 1:
            raise ValueError(f"a topology needs at least one engine of at least one rank, got {spec!r}")
        return topology

    @property
    def trainers(self) -> int:
        return sum(self.trainer_nodes)

    def box(self) -> netbox.Box:
        return netbox.Box(self.trainer_nodes + (self.tp,) * self.engines, self.link, self.nic)

    def trainer_place(self, rank: int) -> tuple[int, int]:
        """(node, slot) of trainer rank `rank`."""
        for node, count in enumerate(self.trainer_nodes):
            if rank < count:
                return node, rank
            rank -= count
        raise ValueError(f"no trainer rank beyond {self.trainers - 1} in topology {self.name!r}")

    def engine_place(self, index: int) -> tuple[int, int]:
        """(node, slot) of engine-rank process `index` (engine index // tp, its rank index % tp)."""
        if not 0 <= index < self.engines * self.tp:
            raise ValueError(f"no engine-rank process {index} in topology {self.name!r}")
        return len(self.trainer_nodes) + index // self.tp, index % self.tp

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name, "trainer_nodes": list(self.trainer_nodes), "engines": self.engines, "tp": self.tp,
            "link_gbit": self.link.gbit, "latency_ms": self.link.latency_ms, "loss_percent": self.link.loss_percent,
            "nic": self.nic, "nics": [n.name for n in self.box().nics()],
        }


def enter(topology: Topology) -> None:
    """Make and shape the box; the processes this one starts afterwards are in it. Call before
    any thread starts."""
    netbox.enter_namespace()
    netbox.shape(topology.box())


def join(topology: Topology | None, role: Literal["trainer", "engine"], index: int) -> None:
    """Join trainer rank / engine-rank process `index`'s node (nothing outside a cluster)."""
    if topology is None:
        return
    node, slot = topology.trainer_place(index) if role == "trainer" else topology.engine_place(index)
    netbox.join(topology.box(), node, slot)


def nic_bytes(topology: Topology) -> dict[str, int]:
    """Bytes each NIC has sent so far (a counter: take differences)."""
    return netbox.nic_bytes(topology.box())


def _receive_link(topology: Topology, port: int, nbytes: int, ready: Any) -> None:
    """The far end of `measure_link`: the first engine node's first rank."""
    address = netbox.join(topology.box(), len(topology.trainer_nodes), 0)
    with socket.create_server((address, port)) as server:
        ready.set()
        connection, _ = server.accept()
        with connection:
            left, chunk = nbytes, bytearray(1 << 20)
            while left:
                got = connection.recv_into(chunk, min(left, len(chunk)))
                if not got:
                    raise RuntimeError(f"the link measurement's sender closed with {left} bytes to go")
                left -= got
            connection.sendall(b"k")


def _send_link(topology: Topology, port: int, nbytes: int, seconds: Any) -> None:
    """The near end of `measure_link`: trainer node 0's first rank; times the bytes until acknowledged."""
    netbox.join(topology.box(), 0, 0)
    box = topology.box()
    far = box.address(len(topology.trainer_nodes), 0)
    payload = bytes(1 << 20)
    with socket.create_connection((far, port), timeout=600) as connection:
        start = time.monotonic()
        for offset in range(0, nbytes, len(payload)):
            connection.sendall(payload[: min(len(payload), nbytes - offset)])
        if connection.recv(1) != b"k":
            raise RuntimeError("the link measurement's receiver did not acknowledge")
        seconds.value = time.monotonic() - start


def measure_link(topology: Topology, nbytes: int) -> dict[str, Any]:
    """The rate one TCP connection gets from trainer node 0 to the first engine node (GB/s),
    each end a process joined to its node, nothing else running."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    ready, seconds = ctx.Event(), ctx.Value("d", 0.0)
    port = 29400
    receiver = ctx.Process(target=_receive_link, args=(topology, port, nbytes, ready))
    receiver.start()
    if not ready.wait(120):
        receiver.kill()
        raise RuntimeError("the link measurement's receiver did not start")
    sender = ctx.Process(target=_send_link, args=(topology, port, nbytes, seconds))
    sender.start()
    for process in (sender, receiver):
        process.join(600)
        if process.exitcode != 0:
            raise RuntimeError(f"the link measurement's {process.name} exited with {process.exitcode}")
    return {"bytes": nbytes, "seconds": seconds.value, "gbps": nbytes / seconds.value / 1e9,
            "configured_gbps": topology.link.gbit / 8}
