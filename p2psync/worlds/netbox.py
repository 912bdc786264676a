"""A cluster in a box: emulated nodes on one machine, linked as a cluster's nodes are.

Point-to-point sync pays where the links between trainer and engine nodes are the bottleneck
while the links inside a node are an order of magnitude faster. On one machine every link is
loopback memory; in a network namespace of its own (`enter_namespace`), loopback carries the
whole 127.0.0.0/8 range, so node N's processes bind the addresses 127.0.N+1.x
(`Box.address`), and `shape` puts one htb class per emulated NIC on `lo`: traffic between
two addresses of one node stays unshaped (NVLink's place), traffic that leaves a node goes
through its sending NIC's class at the link's rate, loses its share of packets there, and
waits out the link's latency as it arrives (`delay`: a netfilter queue, since this kernel
has no netem). Each process of the box calls `join` first: its sockets then leave from its
NIC's address (policy routing by file-system uid: no transport binds its client sockets) and
its host name resolves to its own address. `nic_bytes` reads what each NIC's class carried;
`cut` drops every packet to and from a node (its link pulled) and `lose` a share of them (a
flaky link), until `mend`.

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

from ..core.host import HOST_ENV
from . import delay

#: Names the box's namespace (its inode) to the processes started in it.
BOX_ENV = "P2PSYNC_BOX_NETNS"
#: `unshare(2)`'s flag for a new network namespace.
CLONE_NEWNET = 0x40000000
#: The htb classes of traffic inside a node (unshaped), of what a cut drops and of what a
#: lossy link drops (their leaves blackholes: this kernel has no tc actions), and the first NIC's.
INSIDE_CLASS, CUT_CLASS, LOSS_CLASS, FIRST_NIC_CLASS = 1, 2, 3, 16
#: Filter priorities: cut links first, then traffic inside a node, then a link's losses (its own,
#: then those `lose` adds until `mend`), then each NIC.
CUT_PRIO, INSIDE_PRIO, LOSS_PRIO, LOSING_PRIO, NIC_PRIO = 1, 2, 3, 4, 5
#: The file-system uid of the first NIC's processes, and the routing table of the first NIC
#: (a process's sockets take their source address from its NIC's table: `join`).
FIRST_UID, FIRST_TABLE = 20000, 100
#: Where the loopback routes (the `local` table) are looked up once the NICs' rules are first.
LOCAL_RULE_PREF = 1000
#: Linux's `unshare`, `mount` and capability constants.
CLONE_NEWNS, CLONE_NEWUTS = 0x00020000, 0x04000000
MS_BIND, MS_REC, MS_PRIVATE, MNT_DETACH = 4096, 16384, 1 << 18, 2
CAPABILITY_VERSION_3 = 0x20080522


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
        if self.latency_ms < 0:
            raise ValueError(f"latency must be >= 0 ms, got {self.latency_ms}")
        if self.loss_percent:
            loss_bits(self.loss_percent)

    @property
    def loss_bits(self) -> int | None:
        """`loss_bits` of this link's loss; None for a link that loses nothing."""
        return loss_bits(self.loss_percent) if self.loss_percent else None


def loss_bits(percent: float) -> int:
    """k where a link losing `percent` drops every packet whose IP identification is 1 modulo
    2^k (1 in 2^k of a connection's packets: deterministic, and needs no netem; not 0 modulo
    2^k, since handshake packets carry identification 0 and would be dropped every time)."""
    k = next((k for k in range(1, 17) if abs(100 / 2**k - percent) < 1e-9), None)
    if k is None:
        raise ValueError(f"loss must be 100/2^k percent (50, 25, 12.5, 6.25, 3.125, ...; k up to 16), got {percent}")
    return k


@dataclass(frozen=True)
class Nic:
    """One emulated NIC: its name, htb class (tc writes class numbers in hex), the addresses
    (`prefix`) that send through it, and the source address its processes' sockets get (they
    run with file-system uid `uid`, which selects that source by policy routing)."""

    name: str
    classid: int
    prefix: str
    source: str
    uid: int


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
            sides = [(f"node{n}", self.node_prefix(n), self.address(n, 0)) for n in range(len(self.ranks))]
        else:
            sides = [(f"node{n}/rank{s}", f"{self.address(n, s)}/32", self.address(n, s))
                     for n, count in enumerate(self.ranks) for s in range(count)]
        return [Nic(name, FIRST_NIC_CLASS + i, prefix, source, FIRST_UID + i)
                for i, (name, prefix, source) in enumerate(sides)]

    def nic_of(self, node: int, slot: int) -> Nic:
        """The NIC process `slot` of `node` sends through."""
        address = self.address(node, slot)
        return next(n for n in self.nics() if n.source == address or (self.nic == "node" and n.name == f"node{node}"))

    def hostname(self, node: int, slot: int) -> str:
        return f"p2psync-node{node}-{slot}"


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
    for classid in (INSIDE_CLASS, CUT_CLASS, LOSS_CLASS):
        _run([tc, "class", "add", "dev", "lo", "parent", "1:", "classid", f"1:{classid:x}", "htb", "rate", "100gbit"])
    for classid in (CUT_CLASS, LOSS_CLASS):
        _run([tc, "qdisc", "add", "dev", "lo", "parent", f"1:{classid:x}", "handle", f"{classid:x}:", "blackhole"])
    rate = f"{box.link.gbit * 1000:.0f}mbit"
    for nic in nics:
        _run([tc, "class", "add", "dev", "lo", "parent", "1:", "classid", f"1:{nic.classid:x}", "htb", "rate", rate,
              "ceil", rate])
        if box.link.loss_bits is not None:
            _drop_share(tc, LOSS_PRIO, "src", nic.prefix, box.link.loss_bits)
    for node in range(len(box.ranks)):
        prefix = box.node_prefix(node)
        _run([tc, "filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", str(INSIDE_PRIO), "u32",
              "match", "ip", "src", prefix, "match", "ip", "dst", prefix, "flowid", f"1:{INSIDE_CLASS}"])
    for nic in nics:
        _run([tc, "filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", str(NIC_PRIO), "u32",
              "match", "ip", "src", nic.prefix, "flowid", f"1:{nic.classid:x}"])
    _route_sources(nics)
    if box.link.latency_ms:
        _add_latency(box)
    return nics


def _route_sources(nics: list[Nic]) -> None:
    """Give every socket of a NIC's processes that NIC's source address, whoever opens it (gloo,
    Mooncake, UCX and HTTP clients bind none): a rule per NIC's uid looks up a table whose
    loopback route prefers that source, ahead of the `local` table."""
    ip = _tool("ip", "iproute2's `ip`")
    _run([ip, "rule", "add", "pref", str(LOCAL_RULE_PREF), "lookup", "local"])
    _run([ip, "rule", "del", "pref", "0"])
    for i, nic in enumerate(nics):
        table = str(FIRST_TABLE + i)
        _run([ip, "route", "add", "local", "127.0.0.0/8", "dev", "lo", "src", nic.source, "table", table])
        _run([ip, "rule", "add", "pref", str(10 + i), "uidrange", f"{nic.uid}-{nic.uid}", "lookup", table])


def join(box: Box, node: int, slot: int) -> str:
    """Make this process process `slot` of `node` of the (shaped) box: its sockets leave from
    its NIC's address, its host name resolves to its own address (gloo binds what the host name
    resolves to), and P2PSYNC_HOST names it to p2psync's servers. Call first thing in the
    process, before any thread starts (namespaces and the file-system uid are per thread).
    Returns the address."""
    if not in_own_namespace():
        raise NamespaceError("join a box only inside its namespace (a process started by one that entered it)")
    if threading.active_count() != 1:
        raise NamespaceError("join the box before any thread starts: namespaces and the file-system uid are per thread")
    address, name, nic = box.address(node, slot), box.hostname(node, slot), box.nic_of(node, slot)
    libc = ctypes.CDLL(None, use_errno=True)
    _check(libc.unshare(CLONE_NEWNS | CLONE_NEWUTS), "unshare(CLONE_NEWNS | CLONE_NEWUTS)")
    _check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "making / private to this process")
    libc.umount2(b"/etc/hosts", MNT_DETACH)  # the hosts file of a box process that started this one (if any)
    hosts = f"/tmp/p2psync-box-hosts-{os.getpid()}"
    with open(hosts, "w") as f:  # every process of the box, so that reverse lookups name them too
        f.write("127.0.0.1 localhost\n" + "".join(
            f"{box.address(n, s)} {box.hostname(n, s)}\n" for n, count in enumerate(box.ranks) for s in range(count)
        ))
    _check(libc.mount(hosts.encode(), b"/etc/hosts", None, MS_BIND, None), "bind-mounting its hosts file")
    os.unlink(hosts)  # the mount holds the file
    _check(libc.sethostname(name.encode(), len(name)), "sethostname")
    libc.setfsuid(nic.uid)
    _restore_capabilities(libc)
    os.environ[HOST_ENV] = address
    return address


def _restore_capabilities(libc: ctypes.CDLL) -> None:
    """A new file-system uid drops root's file capabilities from the effective set: raise every
    permitted one again, so that the process reads and writes files as before."""

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    header, data = Header(CAPABILITY_VERSION_3, 0), (Data * 2)()
    _check(libc.capget(ctypes.byref(header), data), "capget")
    for half in data:
        half.effective = half.permitted
    _check(libc.capset(ctypes.byref(header), data), "capset")


def _check(result: int, what: str) -> None:
    if result != 0:
        raise NamespaceError(f"{what} failed: {os.strerror(ctypes.get_errno())}")


def nic_bytes(box: Box) -> dict[str, int]:
    """Bytes each NIC of `box` has sent since `shape` (its class's counter)."""
    counters = _class_counters()
    return {nic.name: counters.get(nic.classid, (0, 0))[0] for nic in box.nics()}


def _class_counters() -> dict[int, tuple[int, int]]:
    """(bytes sent, packets dropped) of every htb class on this namespace's `lo`."""
    out = subprocess.run([_tool_in_box(), "-s", "class", "show", "dev", "lo"], capture_output=True, text=True,
                         check=True).stdout
    pattern = r"class htb 1:([0-9a-f]+) .*?\n\s*Sent (\d+) bytes \d+ pkt \(dropped (\d+)"
    return {int(m[1], 16): (int(m[2]), int(m[3])) for m in re.finditer(pattern, out)}


def cut(box: Box, node: int) -> None:
    """Drop every packet to or from `node` (its link pulled) until `mend`."""
    tc = _tool_in_box()
    prefix = box.node_prefix(node)
    for side in ("src", "dst"):
        _run([tc, "filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", str(CUT_PRIO), "u32",
              "match", "ip", side, prefix, "flowid", f"1:{CUT_CLASS:x}"])


def lose(box: Box, node: int, percent: float) -> None:
    """Drop `percent` of the packets to or from `node` that cross its link (a flaky link),
    until `mend`."""
    tc, bits, prefix = _tool_in_box(), loss_bits(percent), box.node_prefix(node)
    for side in ("src", "dst"):
        _drop_share(tc, LOSING_PRIO, side, prefix, bits)


def _drop_share(tc: str, prio: int, side: str, prefix: str, bits: int) -> None:
    """A filter at `prio` sending 1 in 2^`bits` packets whose `side` address is in `prefix` to
    the blackhole of lossy links (`loss_bits`: IP identification 1 modulo 2^bits)."""
    mask = f"0x{(1 << bits) - 1:04x}"
    _run([tc, "filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", str(prio), "u32",
          "match", "ip", side, prefix, "match", "u16", "0x0001", mask, "at", "4", "flowid", f"1:{LOSS_CLASS:x}"])


#: The process that holds packets for the box's latency (`delay`): kept while this one lives.
_delayer: subprocess.Popen[str] | None = None


def _add_latency(box: Box) -> None:
    """Every packet that arrives at a node from another waits the link's latency: an INPUT
    rule per node hands them to `delay`'s queue. iptables' legacy tables, since its nftables
    front end turns NFQUEUE into nft's queue expression, which this kernel lacks."""
    global _delayer
    iptables = _tool("iptables-legacy", "iptables' `iptables-legacy`", "iptables")
    _delayer = delay.start(box.link.latency_ms / 1000)
    for node in range(len(box.ranks)):
        prefix = box.node_prefix(node)
        _run([iptables, "-w", "-A", "INPUT", "-s", prefix, "!", "-d", prefix, "-j", "NFQUEUE", "--queue-num",
              str(delay.QUEUE)])


def lost_packets() -> int:
    """Packets the box's lossy links have dropped since `shape`."""
    return _class_counters().get(LOSS_CLASS, (0, 0))[1]


def mend() -> None:
    """Undo every `cut` and every `lose` (the link's own loss stays)."""
    tc = _tool_in_box()
    for prio in (CUT_PRIO, LOSING_PRIO):
        listed = subprocess.run([tc, "filter", "show", "dev", "lo", "parent", "1:", "prio", str(prio)],
                                capture_output=True, text=True, check=True).stdout
        if listed.strip():
            _run([tc, "filter", "del", "dev", "lo", "parent", "1:", "prio", str(prio)])


def _tool_in_box() -> str:
    """`tc`, once this process is in a namespace of its own (never the machine's loopback)."""
    if not in_own_namespace():
        raise NamespaceError("refusing to shape the machine's own loopback: enter_namespace() first")
    return _tool("tc", "iproute2's `tc`")


def _tool(name: str, what: str, package: str = "iproute2") -> str:
    path = shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.access(p, os.X_OK)),
                                      None)
    if path is None:
        raise NamespaceError(f"{what} is not installed (apt-get install {package})")
    return path


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise NamespaceError(f"`{' '.join(command)}` failed: {done.stderr.strip() or done.stdout.strip()}")
