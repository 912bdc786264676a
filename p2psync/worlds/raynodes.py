"""A multi-node Ray cluster on one machine: what its users' jobs look like, emulated.

Each node is a network namespace of its own, joined to the others through a bridge in a
switch namespace by a veth pair that carries loopback-range addresses only: node i has
127.0.i+1.1 on its `NIC` (its `lo` keeps 127.0.0.1 alone, so a process that publishes
127.0.0.1 publishes an address no other node reaches, as on a real cluster). A Ray node is
started inside each namespace with its node's address (the head on the first), every Ray
process with the cluster's own auth token; drivers run inside a node too (`run`), since a
Ray process left alone dials the machine's interface address. `cut` pulls a node's link,
`mend` plugs it back. `close` ends every process in the namespaces by pid (never
`ray stop`, which ends Ray processes machine-wide) and deletes them.

Needs root and iproute2 (`NamespaceError` names what is missing).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from .netbox import NamespaceError

#: The veth end inside each node (the same name on every node, so GLOO_SOCKET_IFNAME names it).
NIC = "p2p0"
#: The custom Ray resource that pins an actor to node i: `{resource(i): 1}`.
RESOURCE = "p2psync_node_{}"
#: Ray's port on the head node.
HEAD_PORT = 6379


def resource(node: int) -> str:
    return RESOURCE.format(node)


#: The most bytes of a Unix socket's path (sun_path less its terminating NUL).
AF_UNIX_PATH_MAX = 107
#: The longest path Ray gives a socket below the folder of node i (its session folder is named
#: by the start's date and time and the pid).
RAY_SOCKET_TAIL = "/n249/session_2026-12-07_22-19-40_077689_4194304/sockets/plasma_store"


def address(node: int) -> str:
    """Node `node`'s address (loopback range, routed between the emulated nodes)."""
    return f"127.0.{node + 1}.1"


class RayNodes:
    """`cpus[i]` logical CPUs on node i and `gpus[i]` logical GPUs (Ray's scheduling only: every
    node shares the machine's cores, and a framework that places its workers by GPU places them
    on CPU engines alike); Ray's files under `folder`."""

    def __init__(
        self, cpus: Sequence[int], folder: str | Path, *, gpus: Sequence[int] = (), prefix: str | None = None
    ) -> None:
        self.folder = Path(folder).resolve()
        if len(str(self.folder)) + len(RAY_SOCKET_TAIL) > AF_UNIX_PATH_MAX:
            raise ValueError(
                f"Ray's folder {str(self.folder)!r} is too long for its sockets: Ray puts them at"
                f" {RAY_SOCKET_TAIL!r} below it, and a socket's path has at most {AF_UNIX_PATH_MAX} bytes;"
                f" give a folder of at most {AF_UNIX_PATH_MAX - len(RAY_SOCKET_TAIL)} characters"
            )
        if os.geteuid() != 0:
            raise NamespaceError("emulated Ray nodes need root (network namespaces)")
        if not shutil.which("ip"):
            raise NamespaceError("emulated Ray nodes need iproute2 (`ip`)")
        if not 1 <= len(cpus) <= 250:
            raise ValueError(f"1 to 250 nodes, got {len(cpus)}")
        if len(gpus) not in (0, len(cpus)):
            raise ValueError(f"gpus names {len(gpus)} nodes, cpus {len(cpus)}")
        self.cpus = list(cpus)
        self.gpus = list(gpus) or [0] * len(cpus)
        self.prefix = prefix or f"p2pray{os.getpid()}"
        self.switch = f"{self.prefix}-sw"
        self.namespaces = [f"{self.prefix}-n{i}" for i in range(len(cpus))]
        self.env = {
            "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
            "GLOO_SOCKET_IFNAME": NIC, "PYTHONUNBUFFERED": "1",
        }
        self._made: list[str] = []

    @property
    def head(self) -> str:
        return f"{address(0)}:{HEAD_PORT}"

    def __enter__(self) -> RayNodes:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the network ---------------------------------------------------------------------------

    def start(self) -> None:
        """Make the namespaces and links, then start Ray on every node."""
        self._ip("netns", "add", self.switch)
        self._made.append(self.switch)
        self._ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        self._ip("-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.namespaces):
            self._make_node(i, ns)
        for i, ns in enumerate(self.namespaces):
            for j in range(len(self.namespaces)):
                if j != i:
                    self._ip("-n", ns, "route", "add", f"127.0.{j + 1}.0/24", "dev", NIC)
        for i in range(len(self.namespaces)):
            self._start_ray(i)

    def _make_node(self, i: int, ns: str) -> None:
        self._ip("netns", "add", ns)
        self._made.append(ns)
        self._ip("link", "add", NIC, "netns", ns, "type", "veth", "peer", "name", f"port{i}", "netns", self.switch)
        self._ip("-n", self.switch, "link", "set", f"port{i}", "master", "br0")
        self._ip("-n", self.switch, "link", "set", f"port{i}", "up")
        keys = [f"net.ipv4.conf.{dev}.{knob}" for dev in ("all", "default", NIC) for knob in ("route_localnet", "rp_filter")]
        values = [f"{k}={1 if k.endswith('route_localnet') else 0}" for k in keys]
        self._run_in(i, ["sysctl", "-qw", *values])
        self._ip("-n", ns, "link", "set", "lo", "up")
        self._ip("-n", ns, "addr", "del", "127.0.0.1/8", "dev", "lo")
        self._ip("-n", ns, "addr", "add", "127.0.0.1/32", "dev", "lo")
        self._ip("-n", ns, "addr", "add", f"{address(i)}/24", "dev", NIC)
        self._ip("-n", ns, "link", "set", NIC, "up")

    def cut(self, node: int) -> None:
        """Pull node `node`'s link: nothing reaches it or leaves it until `mend`."""
        self._ip("-n", self.switch, "link", "set", f"port{node}", "down")

    def mend(self, node: int) -> None:
        self._ip("-n", self.switch, "link", "set", f"port{node}", "up")

    # -- Ray -----------------------------------------------------------------------------------

    def _start_ray(self, i: int) -> None:
        ray = str(Path(sys.executable).with_name("ray"))
        where = ["--head", f"--port={HEAD_PORT}", "--include-dashboard=false"] if i == 0 else [f"--address={self.head}"]
        self._run_in(i, [
            ray, "start", *where, f"--node-ip-address={address(i)}", f"--num-cpus={self.cpus[i]}",
            f"--num-gpus={self.gpus[i]}",
            f'--resources={{"{resource(i)}": 100}}', "--object-store-memory=83886080",
            f"--temp-dir={self.folder / f'n{i}'}", "--disable-usage-stats",
        ], timeout=120)

    def run(
        self, node: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        """Run `argv` inside node `node` with the cluster's Ray settings (a driver: `ray.init(
        address=nodes.head)`), capturing its output."""
        return self._run_in(node, argv, env=env, timeout=timeout, check=False)

    def _run_in(
        self, node: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float = 60,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        full_env = {**os.environ, **self.env, **(env or {})}
        done = subprocess.run(
            ["ip", "netns", "exec", self.namespaces[node], *argv], env=full_env, capture_output=True, text=True,
            timeout=timeout,
        )
        if check and done.returncode:
            raise NamespaceError(f"{' '.join(argv[:3])} on node {node} failed ({done.returncode}): "
                                 f"{(done.stderr or done.stdout)[-2000:]}")
        return done

    def _ip(self, *args: str) -> None:
        done = subprocess.run(["ip", *args], capture_output=True, text=True)
        if done.returncode:
            raise NamespaceError(f"ip {' '.join(args)}: {done.stderr.strip()}")

    # -- teardown ------------------------------------------------------------------------------

    def pids(self) -> list[int]:
        """Every process in the cluster's namespaces."""
        out: list[int] = []
        for ns in self._made:
            listed = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
            out += [int(p) for p in listed.split()]
        return out

    def close(self) -> None:
        """End every process in the namespaces (by pid), then delete them."""
        for _ in range(20):
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()
