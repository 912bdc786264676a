"""Latency for the cluster in a box, without netem: every packet that crosses into another
emulated node waits `seconds` in a netfilter queue before the kernel lets it in.

This machine's kernel has no netem qdisc (sch_netem), but it has iptables' NFQUEUE target
and nfnetlink_queue: an INPUT rule (`netbox.shape`) hands each packet that arrives from
another node to queue `QUEUE`, and this module, running as a process of its own inside the
box's namespace (`start`), accepts each one once it has waited. The packets are held on the
receiving side, after loopback has let go of them: held on the sending side (OUTPUT), they
would still count against the sender's TCP small queues, which then allow two packets in
flight and cap a 100 ms link at about 2.6 MB/s.

The kernel numbers a queue's packets in arrival order and every packet waits the same
time, so one batch verdict ("accept every packet up to id N") releases all that are due,
including any whose message this process missed when its socket overflowed.

The protocol is nfnetlink_queue's (linux/netfilter/nfnetlink_queue.h), spoken over a raw
netlink socket: no library beyond Python's own.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time

#: The netfilter queue the box's latency rules use.
QUEUE = 7
#: How many packets the kernel holds for the queue before it drops new ones.
QUEUE_LENGTH = 1 << 16

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 2, 3
NLM_F_REQUEST, NLM_F_ACK, NLMSG_ERROR = 1, 4, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NFQNL_CFG_CMD_BIND, NFQNL_COPY_META, NFQA_CFG_F_GSO, NF_ACCEPT = 1, 1, 4, 1
NLMSG_HEADER = struct.Struct("=IHHII")
PR_SET_PDEATHSIG = 1
READY = "ready"


def _attribute(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


class Delayer:
    """Holds every packet of netfilter queue `queue` for `seconds`, then accepts it."""

    def __init__(self, queue: int, seconds: float) -> None:
        self.queue, self.seconds, self._sequence = queue, seconds, 0
        self._socket = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self._socket.bind((0, 0))
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self._send(NFQNL_MSG_CONFIG, _attribute(NFQA_CFG_CMD, struct.pack("!BBH", NFQNL_CFG_CMD_BIND, 0, 0)), ack=True)
        self._send(NFQNL_MSG_CONFIG, b"".join((
            _attribute(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META)),  # ids only, no payload
            _attribute(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", QUEUE_LENGTH)),
            _attribute(NFQA_CFG_MASK, struct.pack("!I", NFQA_CFG_F_GSO)),  # whole GSO packets, not segmented
            _attribute(NFQA_CFG_FLAGS, struct.pack("!I", NFQA_CFG_F_GSO)),
        )), ack=True)

    def _send(self, message: int, attributes: bytes, *, ack: bool = False) -> None:
        self._sequence += 1
        body = struct.pack("!BBH", socket.AF_UNSPEC, 0, self.queue) + attributes
        flags = NLM_F_REQUEST | (NLM_F_ACK if ack else 0)
        self._socket.send(NLMSG_HEADER.pack(NLMSG_HEADER.size + len(body), (NFNL_SUBSYS_QUEUE << 8) | message, flags,
                                            self._sequence, 0) + body)
        if ack:
            reply = self._socket.recv(1 << 16)
            kind = struct.unpack_from("=H", reply, 4)[0]
            code = struct.unpack_from("=i", reply, NLMSG_HEADER.size)[0] if kind == NLMSG_ERROR else 0
            if code:
                raise OSError(-code, f"nfnetlink_queue refused the configuration of queue {self.queue}: "
                                     f"{os.strerror(-code)}")

    def _packet_ids(self, data: bytes) -> list[int]:
        """The ids of the packets announced in one read of the socket."""
        ids, offset = [], 0
        while offset + NLMSG_HEADER.size <= len(data):
            length, kind = struct.unpack_from("=IH", data, offset)
            if length < NLMSG_HEADER.size:
                break
            if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                at = offset + NLMSG_HEADER.size + 4  # past the nfgenmsg
                while at + 4 <= offset + length:
                    size, attribute = struct.unpack_from("=HH", data, at)
                    if size < 4:
                        break
                    if attribute & 0x7FFF == NFQA_PACKET_HDR:
                        ids.append(struct.unpack_from("!I", data, at + 4)[0])
                    at += (size + 3) & ~3
            offset += (length + 3) & ~3
        return ids

    def run(self) -> None:
        """Hold and release packets until the process is killed."""
        held: collections.deque[tuple[float, int]] = collections.deque()
        while True:
            wait = max(0.0, held[0][0] + self.seconds - time.monotonic()) if held else None
            readable, _, _ = select.select([self._socket], [], [], wait)
            now = time.monotonic()
            if readable:
                try:
                    held.extend((now, packet) for packet in self._packet_ids(self._socket.recv(1 << 20)))
                except OSError as exc:  # messages lost to a full socket: their packets wait in the kernel and
                    if exc.errno != errno.ENOBUFS:  # go with the next batch verdict past their ids
                        raise
            due = None
            while held and held[0][0] + self.seconds <= now:
                due = held.popleft()[1]
            if due is not None:
                self._send(NFQNL_MSG_VERDICT_BATCH, _attribute(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, due)))


def start(seconds: float, queue: int = QUEUE) -> subprocess.Popen[str]:
    """Start a delayer process for `queue` (in this process's network namespace), returning
    once it holds the queue; it dies with this process."""
    process = subprocess.Popen([sys.executable, "-m", __name__, str(queue), repr(seconds), str(os.getpid())],
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    if line != READY:
        process.kill()
        raise RuntimeError(f"the box's latency process did not start (it said {line!r}; exit {process.wait()})")
    return process


def _main(queue: int, seconds: float, parent: int) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the signal was asked for
        return
    delayer = Delayer(queue, seconds)
    print(READY, flush=True)
    delayer.run()


if __name__ == "__main__":
    _main(int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]))
