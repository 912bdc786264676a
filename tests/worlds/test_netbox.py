"""The cluster in a box: in a network namespace the test makes, `lo`'s traffic between two
emulated nodes goes through the sending NIC's class (its counter carries the bytes) while
traffic inside a node bypasses every NIC; gloo ranks that joined the box send from their
own NIC with no binding of their own; a cut node receives nothing until mended; the
machine's own loopback is never shaped; a link with latency delays every packet between
nodes and none inside one. Skipped, naming what is missing, where the machine lacks root,
iproute2 or (for latency) iptables."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.box import run_in_box

from p2psync.worlds.netbox import Box, Link, NamespaceError, in_own_namespace, shape


#: Runs in a fresh interpreter: enters a namespace, shapes a box of 2 + 1 ranks, sends MB
#: bytes inside node 0 and from node 0 to node 1, cuts node 1, tries again, mends, again.
SCRIPT = """
import json, socket, sys, threading
from p2psync.worlds.netbox import Box, Link, cut, enter_namespace, in_own_namespace, mend, nic_bytes, shape
enter_namespace()
box = Box((2, 1), Link(gbit=0.8))
shape(box)
received = {}
def serve(address):
    server = socket.create_server((address, 5000))
    def loop():
        while True:
            conn, _ = server.accept()
            while data := conn.recv(1 << 20):
                received[address] = received.get(address, 0) + len(data)
    threading.Thread(target=loop, daemon=True).start()
inside, across = box.address(0, 1), box.address(1, 0)
for address in (inside, across):
    serve(address)
def send(address, nbytes):
    try:
        with socket.create_connection((address, 5000), timeout=2, source_address=(box.address(0, 0), 0)) as conn:
            conn.sendall(b"x" * nbytes)
        return "sent"
    except OSError as exc:
        return type(exc).__name__
MB = 1 << 20
outcomes = [send(inside, 4 * MB), send(across, 4 * MB)]
import time; time.sleep(0.5)
counted = nic_bytes(box)
cut(box, 1)
outcomes += [send(across, MB), send(inside, MB)]
mend()
outcomes.append(send(across, MB))
time.sleep(0.5)
print(json.dumps({"outcomes": outcomes, "counted": counted, "received": received, "own": in_own_namespace()}))
"""


def test_links_between_nodes_go_through_the_sending_nic_and_a_cut_node_is_unreachable(tmp_path):
    result = _in_box(tmp_path, SCRIPT)
    mb = 1 << 20
    assert result["own"]
    assert result["outcomes"] == ["sent", "sent", "TimeoutError", "sent", "sent"], result
    counted = result["counted"]
    # node 0 rank 0's NIC carried the 4 MB to node 1 (plus headers), none of the 4 MB inside node 0
    assert 4 * mb <= counted["node0/rank0"] < 4.5 * mb, counted
    assert counted["node0/rank1"] == 0 and counted["node1/rank0"] < 0.1 * mb, counted  # node 1 sent only acks
    assert result["received"] == {"127.0.1.2": 5 * mb, "127.0.2.1": 5 * mb}, result["received"]


#: Three gloo ranks (node 0: ranks 0 and 1; node 1: rank 2), each joining the box first, then
#: an all-gather of 1 MB per rank: gloo's ring sends rank 0 -> 1 (inside node 0), 1 -> 2 and
#: 2 -> 0 (across), two chunks each.
GLOO = """
import json, socket, subprocess, sys
from p2psync.worlds.netbox import Box, Link, enter_namespace, join, nic_bytes, shape
BOX, PLACES = Box((2, 1), Link(gbit=2.0)), [(0, 0), (0, 1), (1, 0)]
if len(sys.argv) == 1:
    enter_namespace()
    shape(BOX)
    ranks = [subprocess.Popen([sys.executable, __file__, str(r)], stdout=subprocess.PIPE, text=True) for r in range(3)]
    outs = [p.communicate(timeout=120)[0] for p in ranks]
    print(json.dumps({"ranks": [json.loads(o.strip().splitlines()[-1]) for o in outs], "bytes": nic_bytes(BOX)}))
else:
    rank = int(sys.argv[1])
    address = join(BOX, *PLACES[rank])
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://{BOX.address(0, 0)}:29700", rank=rank, world_size=3)
    out = [torch.empty(1 << 18) for _ in range(3)]
    dist.all_gather(out, torch.full((1 << 18,), float(rank)))
    dist.barrier()
    print(json.dumps({"address": address, "resolves": socket.gethostbyname(socket.gethostname()),
                      "ok": all(bool((t == i).all()) for i, t in enumerate(out))}))
"""


def test_gloo_ranks_that_joined_the_box_send_through_their_own_nics(tmp_path):
    pytest.importorskip("torch.distributed")
    result = _in_box(tmp_path, GLOO)
    assert [(r["address"], r["resolves"], r["ok"]) for r in result["ranks"]] == [
        ("127.0.1.1", "127.0.1.1", True), ("127.0.1.2", "127.0.1.2", True), ("127.0.2.1", "127.0.2.1", True)
    ], result["ranks"]
    mb, counted = 1 << 20, result["bytes"]
    assert counted["node0/rank0"] < 0.1 * mb, counted  # its ring neighbour is on its node
    assert 2 * mb <= counted["node0/rank1"] < 2.2 * mb and 2 * mb <= counted["node1/rank0"] < 2.2 * mb, counted


#: `send()`: 4 MB from node 0 to node 1 of `box` (made and shaped inside the box) over one TCP
#: connection; whether every byte arrived, and the packets the box has dropped so far.
SEND = """
import json, socket, threading
from p2psync.worlds.netbox import Box, Link, enter_namespace, lose, lost_packets, mend, shape
enter_namespace()
box = Box((1, 1), Link(gbit=1.0, loss_percent=LOSS_PERCENT))
shape(box)
server = socket.create_server((box.address(1, 0), 5000))
payload = bytes(range(256)) * (4 << 12)
def send():
    got = []
    def receive():
        conn, _ = server.accept()
        while data := conn.recv(1 << 20):
            got.append(data)
    thread = threading.Thread(target=receive)
    thread.start()
    with socket.create_connection((box.address(1, 0), 5000), timeout=30, source_address=(box.address(0, 0), 0)) as c:
        c.sendall(payload)
    thread.join(30)
    return {"exact": b"".join(got) == payload, "lost": lost_packets()}
"""


def test_a_lossy_link_drops_packets_and_tcp_still_delivers_every_byte(tmp_path):
    script = SEND.replace("LOSS_PERCENT", "6.25") + "print(json.dumps(send()))\n"
    result = _in_box(tmp_path, script)
    assert result["exact"] and result["lost"] > 0, result


#: Three times over a clean link: as is, while `lose` drops 1 packet in 16 to or from node 1,
#: and after `mend` (twice: mending nothing is no error).
LOSING = SEND.replace("LOSS_PERCENT", "0.0") + """
clean = send()
lose(box, 1, 6.25)
losing = send()
mend()
mend()
mended = send()
print(json.dumps({"clean": clean, "losing": losing, "mended": mended}))
"""


def test_a_link_made_lossy_drops_packets_until_mended(tmp_path):
    result = _in_box(tmp_path, LOSING)
    assert result["clean"] == {"exact": True, "lost": 0}, result
    assert result["losing"]["exact"] and result["losing"]["lost"] > 0, result
    assert result["mended"] == {"exact": True, "lost": result["losing"]["lost"]}, result


#: A box of 2 + 1 ranks whose links add 50 ms: round trips of one byte inside node 0 and from
#: node 0 to node 1, each on a connection of its own, and 4 MB sent across.
LATENCY = SEND.replace("Box((1, 1)", "Box((2, 1)").replace("loss_percent=LOSS_PERCENT", "latency_ms=50.0") + """
import time
def echo(address):
    server = socket.create_server((address, 5001))
    def loop():
        conn, _ = server.accept()
        while conn.recv(1):
            conn.sendall(b"k")
    threading.Thread(target=loop, daemon=True).start()
def round_trips(address):
    with socket.create_connection((address, 5001), source_address=(box.address(0, 0), 0)) as conn:
        times = []
        for _ in range(3):
            started = time.monotonic()
            conn.sendall(b"p")
            conn.recv(1)
            times.append(time.monotonic() - started)
        return times
echo(box.address(0, 1))
echo(box.address(1, 0))
print(json.dumps({"inside": round_trips(box.address(0, 1)), "across": round_trips(box.address(1, 0)),
                  "sent": send()}))
"""


def test_a_link_with_latency_delays_every_packet_between_nodes_and_none_inside_a_node(tmp_path):
    (tmp_path / "box.py").write_text(LATENCY)
    result = run_in_box(tmp_path / "box.py", tools=("ip", "tc", "iptables-legacy"))
    assert all(0.1 <= t < 0.15 for t in result["across"]), result  # 50 ms each way
    assert all(t < 0.02 for t in result["inside"]), result
    assert result["sent"] == {"exact": True, "lost": 0}, result


def _in_box(tmp_path: Path, script: str) -> dict:
    (tmp_path / "box.py").write_text(script)
    return run_in_box(tmp_path / "box.py")


def test_the_machine_loopback_is_never_shaped():
    assert not in_own_namespace()
    with pytest.raises(NamespaceError, match="refusing to shape the machine's own loopback"):
        shape(Box((1, 1), Link(gbit=1.0)))


def test_a_box_names_what_is_wrong_with_it():
    with pytest.raises(ValueError, match="no process 2 on node 0"):
        Box((2,), Link(gbit=1.0)).address(0, 2)
    with pytest.raises(ValueError, match="rate must be positive"):
        Link(gbit=0)
    with pytest.raises(ValueError, match=r"loss must be 100/2\^k percent"):
        Link(gbit=1.0, loss_percent=5)
    assert Link(gbit=1.0, loss_percent=3.125).loss_bits == 5
    nics = Box((2, 1), Link(gbit=1.0), nic="node").nics()
    assert [(n.name, n.prefix) for n in nics] == [("node0", "127.0.1.0/24"), ("node1", "127.0.2.0/24")]
