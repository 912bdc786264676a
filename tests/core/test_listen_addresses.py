"""Servers p2psync opens listen on the address their peers use, not on every interface (#46,
item 2): a process that reaches this machine at another of its addresses finds nothing there."""

from __future__ import annotations

import socket

import pytest

from p2psync.core.control import ControlServer
from p2psync.core.errors import RendezvousError
from p2psync.core.rendezvous import Rendezvous

#: Two loopback addresses of this machine: the one peers use, and another one.
PEERS, OTHER = "127.0.0.2", "127.0.0.3"


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def test_the_rendezvous_store_listens_on_its_host_only():
    server = Rendezvous(host=PEERS, port=0, job_id="listen", is_server=True, timeout=5)
    client = Rendezvous(host=PEERS, port=server.port, job_id="listen", timeout=5)
    client.set("key", "value")
    assert server.get("key") == b"value"
    assert _answers(PEERS, server.port)
    assert not _answers(OTHER, server.port), "the store listens on every interface"
    assert not _answers("127.0.0.1", server.port), "the store listens on every interface"


def test_a_rendezvous_at_an_address_not_of_this_machine_or_a_taken_port_is_refused_by_name():
    server = Rendezvous(host=PEERS, port=0, job_id="listen", is_server=True, timeout=5)
    with pytest.raises(RendezvousError, match=f"{PEERS}:{server.port}.*in use"):
        Rendezvous(host=PEERS, port=server.port, job_id="listen", is_server=True, timeout=5)
    with pytest.raises(RendezvousError, match="192.0.2.1"):  # TEST-NET-1: no machine's own
        Rendezvous(host="192.0.2.1", port=0, job_id="listen", is_server=True, timeout=5)


def test_the_control_server_listens_on_its_host_only():
    server = ControlServer({}, host=PEERS, token="t")
    try:
        port = int(server.url.rsplit(":", 1)[1])
        assert _answers(PEERS, port)
        assert not _answers(OTHER, port)
    finally:
        server.close()
