"""A cluster in a box: emulated nodes on one machine, linked as a cluster's nodes are.

Point-to-point sync pays where the links between trainer and engine nodes are the
bottleneck while the links inside a node are an order of magnitude faster. On one machine
every link is loopback memory; in a network namespace of its own (`enter_namespace`),
loopback carries the whole 127.0.0.0/8 range, so node N's processes bind the addresses
127.0.N+1.x (`Box.address`), and `shape` puts one htb class per emulated NIC on `lo`:
traffic between two addresses of one node stays unshaped (NVLink's place), traffic that
leaves a node goes through its sending NIC's class at the link's rate, with netem's
latency and loss under it. `nic_bytes` reads what each NIC's class carried; `cut` drops
every packet to and from a node (its link pulled) until `mend`.

Only loopback-range addresses are used, and `shape` refuses the machine's own namespace.
Shaping is on the sending side: a NIC receiving from several senders at once is not
capped (a cluster's receiving NIC is).
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import threading
from dataclasses import dataclass
from typing import Literal

#: Names the box's namespace (its inode) to the processes started in it.
BOX_ENV = "P2PSYNC_BOX_NETNS"
#: `unshare(2)`'s flag for a new network namespace.
CLONE_NEWNET = 0x40000000
#: The htb class of traffic inside a node (unshaped), of what a cut drops (its leaf a
#: blackhole: this kernel has no tc actions), and the first NIC class.
INSIDE_CLASS, CUT_CLASS, FIRST_NIC_CLASS = 1, 2, 16
#: Filter priorities: cut links first, then traffic inside a node, then each NIC.
CUT_PRIO, INSIDE_PRIO, NIC_PRIO = 1, 2, 3


class NamespaceError(RuntimeError):
    """The box cannot be made here; the message names what is missing."""


@dataclass(frozen=True)
class Link:
    """A NIC's link: `gbit` per second out of it, `latency_ms` added to every packet it sends,
    `loss_percent` of them dropped."""

    gbit: float
    latency_ms: float = 0.0
    loss_percent: float = 0.0

    def __post_init__(self) -> None:
        if self.gbit <= 0:
            raise ValueError(f"a link's rate must be positive, got {self.gbit} Gbit/s")
        if self.latency_ms < 0 or not 0 <= self.loss_percent < 100:
            raise ValueError(f"latency {self.latency_ms} ms and loss {self.loss_percent}% must be >= 0 (loss < 100)")


@dataclass(frozen=True)
class Nic:
    """One emulated NIC: its name, htb class (tc writes class numbers in hex) and the addresses
    (`prefix`) that send through it."""

    name: str
    classid: int
    prefix: str


@dataclass(frozen=True)
class Box:
    """Emulated nodes, `ranks[n]` processes on node n, each node's NICs on `link`: one per rank
    (`nic="rank"`, as rail-optimized GPU nodes have) or one per node."""

    ranks: tuple[int, ...]
    link: Link
    nic: Literal["rank", "node"] = "rank"

    def __post_init__(self) -> None:
        if not self.ranks or len(self.ranks) > 250 or not all(1 <= r <= 250 for r in self.ranks):
            raise ValueError(f"a box holds 1-250 nodes of 1-250 ranks each, got {self.ranks}")
        if self.nic not in ("rank", "node"):
            raise ValueError(f"nic must be 'rank' or 'node', got {self.nic!r}")

    def address(self, node: int, slot: int) -> str:
        """The loopback address process `slot` of `node` binds."""
        if not (0 <= node < len(self.ranks) and 0 <= slot < self.ranks[node]):
            raise ValueError(f"no process {slot} on node {node} of a box of {self.ranks}")
        return f"127.0.{node + 1}.{slot + 1}"

    def node_prefix(self, node: int) -> str:
        return f"127.0.{node + 1}.0/24"

    def nics(self) -> list[Nic]:
        if self.nic == "node":
            prefixes = [(f"node{n}", self.node_prefix(n)) for n in range(len(self.ranks))]
        else:
            prefixes = [(f"node{n}/rank{s}", f"{self.address(n, s)}/32")
                        for n, count in enumerate(self.ranks) for s in range(count)]
        return [Nic(name, FIRST_NIC_CLASS + i, prefix) for i, (name, prefix) in enumerate(prefixes)]


def in_own_namespace() -> bool:
    """Whether this process runs in the namespace `enter_namespace` made (here or in a parent,
    which names it in $P2PSYNC_BOX_NETNS), not the machine's."""
    return str(_namespace()) == os.environ.get(BOX_ENV)


def _namespace() -> int:
    return os.stat("/proc/self/ns/net").st_ino


def enter_namespace() -> None:
    """Move this process into a network namespace of its own with `lo` up; every process it
    starts afterwards inherits it. Call before any thread starts (a namespace is per thread)."""
    if threading.active_count() != 1:
        raise NamespaceError("enter the box's network namespace before any thread starts: a namespace is per thread")
    ip = _tool("ip", "iproute2's `ip`")
    machine = _namespace()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise NamespaceError(
            f"unshare(CLONE_NEWNET) failed: {os.strerror(errno)}; a network namespace needs root or CAP_SYS_ADMIN"
        )
    if _namespace() == machine:
        raise NamespaceError("unshare(CLONE_NEWNET) returned but the namespace did not change")
    _run([ip, "link", "set", "lo", "up"])
    os.environ[BOX_ENV] = str(_namespace())  # the processes it starts know they are in the box


def shape(box: Box) -> list[Nic]:
    """Shape `lo` of this (private) namespace as `box`'s links; return its NICs."""
    tc = _tool_in_box()
    nics = box.nics()
    _run([tc, "qdisc", "replace", "dev", "lo", "root", "handle", "1:", "htb", "default", str(INSIDE_CLASS)])
    for classid in (INSIDE_CLASS, CUT_CLASS):
        _run([tc, "class", "add", "dev", "lo", "parent", "1:", "classid", f"1:{classid:x}", "htb", "rate", "100gbit"])
    _run([tc, "qdisc", "add", "dev", "lo", "parent", f"1:{CUT_CLASS:x}", "handle", f"{CUT_CLASS:x}:", "blackhole"])
    rate = f"{box.link.gbit * 1000:.0f}mbit"
    for nic in nics:
        _run([tc, "class", "add", "dev", "lo", "parent", "1:", "classid", f"1:{nic.classid:x}", "htb", "rate", rate,
              "ceil", rate])
        if box.link.latency_ms or box.link.loss_percent:
            _netem(tc, nic, box.link)
    for node in range(len(box.ranks)):
        prefix = box.node_prefix(node)
        _run([tc, "filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", str(INSIDE_PRIO), "u32",
              "match", "ip", "src", prefix, "match", "ip", "dst", prefix, "flowid", f"1:{INSIDE_CLASS}"])
    for nic in nics:
        _run([tc, "filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", str(NIC_PRIO), "u32",
              "match", "ip", "src", nic.prefix, "flowid", f"1:{nic.classid:x}"])
    return nics


def nic_bytes(box: Box) -> dict[str, int]:
    """Bytes each NIC of `box` has sent since `shape` (its class's counter)."""
    out = subprocess.run([_tool_in_box(), "-s", "class", "show", "dev", "lo"], capture_output=True, text=True,
                         check=True).stdout
    sent = {int(m[1], 16): int(m[2]) for m in re.finditer(r"class htb 1:([0-9a-f]+) .*?\n\s*Sent (\d+) bytes", out)}
    return {nic.name: sent.get(nic.classid, 0) for nic in box.nics()}


def cut(box: Box, node: int) -> None:
    """Drop every packet to or from `node` (its link pulled) until `mend`."""
    tc = _tool_in_box()
    prefix = box.node_prefix(node)
    for side in ("src", "dst"):
        _run([tc, "filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", str(CUT_PRIO), "u32",
              "match", "ip", side, prefix, "flowid", f"1:{CUT_CLASS:x}"])


def _netem(tc: str, nic: Nic, link: Link) -> None:
    """Latency and loss under `nic`'s class: netem's, where the kernel has it."""
    command = [tc, "qdisc", "add", "dev", "lo", "parent", f"1:{nic.classid:x}", "handle", f"{nic.classid:x}:",
               "netem", "delay", f"{link.latency_ms}ms", "loss", f"{link.loss_percent}%"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise NamespaceError(
            f"a link's latency and loss need the kernel's netem qdisc (sch_netem): `{' '.join(command)}` failed: "
            f"{done.stderr.strip()}"
        )


def mend() -> None:
    """Undo every `cut`."""
    _run([_tool_in_box(), "filter", "del", "dev", "lo", "parent", "1:", "prio", str(CUT_PRIO)])


def _tool_in_box() -> str:
    """`tc`, once this process is in a namespace of its own (never the machine's loopback)."""
    if not in_own_namespace():
        raise NamespaceError("refusing to shape the machine's own loopback: enter_namespace() first")
    return _tool("tc", "iproute2's `tc`")


def _tool(name: str, what: str) -> str:
    path = shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.access(p, os.X_OK)),
                                      None)
    if path is None:
        raise NamespaceError(f"{what} is not installed (apt-get install iproute2)")
    return path


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise NamespaceError(f"`{' '.join(command)}` failed: {done.stderr.strip() or done.stdout.strip()}")
