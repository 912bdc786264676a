"""The address this process's servers bind and publish to their peers, and the node it is on.

A job's trainers and engines are often Ray actors on many nodes: an address is worth
publishing only if every peer can reach it. In order:

1. `$P2PSYNC_HOST`, where the job names it;
2. under Ray (in a process where Ray is initialized), the node's address, as Ray's own
   processes publish it;
3. the local address of this process's route toward the rendezvous host: the interface
   its peers reach the rendezvous through is the one they reach it through;
4. 127.0.0.1: every peer is on this host.

`node_id` names the network a process is in (host, boot and network namespace), so that a
peer handed a host-local address (127.0.0.1) by a process on another node refuses it at
connect, naming the fix, instead of dialing its own loopback.
"""

from __future__ import annotations

import functools
import importlib
import ipaddress
import os
import socket
import sys
from urllib.parse import urlsplit

#: Names it: unset, chosen as above; in the cluster in a box, the process's emulated node address.
HOST_ENV = "P2PSYNC_HOST"
#: What a host-local address is called in errors and logs.
HOST_LOCAL = ("127.0.0.1", "::1", "localhost")


def local_host(toward: str | None = None) -> str:
    """The address this process publishes (see the module's docstring); `toward`: the
    rendezvous host, whose route picks the interface where neither the job nor Ray does."""
    named = os.environ.get(HOST_ENV)
    if named:
        return named
    ray_address = _ray_node_address()
    if ray_address:
        return ray_address
    if toward and not is_host_local(toward):
        routed = _route_source(toward)
        if routed:
            return routed
    return "127.0.0.1"


def is_host_local(host: str) -> bool:
    """Whether `host` reaches only the host it is dialed on (127.0.0.1, ::1, localhost).
    Other 127.x addresses are host-local on an ordinary machine too, but emulated nodes
    route them between network namespaces, so only these are refused across nodes."""
    return host.strip("[]").lower() in HOST_LOCAL


def host_of(address: str) -> str:
    """The host part of a URL ("http://h:p/..."), a "host:port" pair or a bare host."""
    if "//" in address:
        return urlsplit(address).hostname or ""
    if address.startswith("["):  # [v6]:port
        return address[1:].split("]", 1)[0]
    host, sep, port = address.rpartition(":")
    return host if sep and port.isdigit() and ":" not in host else address


@functools.cache
def node_id() -> str:
    """This process's network: the host's name and boot, and its network namespace."""
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    except OSError:
        boot = ""
    try:
        netns = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        netns = ""
    return f"{socket.gethostname()}/{boot[:8]}/{netns}"


def _ray_node_address() -> str | None:
    ray = sys.modules.get("ray")  # never imported here: only where the job runs under Ray
    if ray is None or not ray.is_initialized():
        return None
    return str(importlib.import_module("ray.util").get_node_ip_address())


def _route_source(host: str) -> str | None:
    """The local address the kernel would send from toward `host` (no packet is sent)."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:  # a name
        try:
            family, *_, sockaddr = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)[0]
            host = str(sockaddr[0])
        except OSError:
            return None
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return None
