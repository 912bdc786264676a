"""NIXL (NVIDIA Inference Xfer Library): one-sided WRITEs over its UCX backend.

Engine side: `expose` creates a NIXL agent, registers the parameter tensors and
publishes the agent's name and metadata (`get_agent_metadata()`, base64) in the
target table. Trainer side: `open` loads that metadata (`add_remote_agent`); each
`Peer.write` turns the batch into one NIXL WRITE request (a local and a remote
descriptor list), posts it and polls it until done, failed or late.

Memory type comes from the tensors: host tensors register as DRAM, CUDA tensors as
VRAM on their device. On the CPU machines this project is tested on, UCX moves
host memory only: same-host puts go zero-copy through cma (process_vm_writev),
connection set-up goes over tcp. VRAM (cuda_ipc, GPUDirect RDMA) goes through the
same calls but cannot be exercised on those machines.

Known problem handled here: the nixl-cu12 1.5.1 wheel bundles its own libibverbs
and libnl, but its UCX EFA module links the system's libefa, which pulls the
system libibverbs and libnl into the same process. With rdma-core's
`ibverbs-providers` installed (as on the CI image), two copies of libnl-route-3
end up loaded and the process dies with SIGSEGV in `rtnl_tc_unregister` at exit,
after all Python code has run (exit status 139). Unless told otherwise
(`ucx_modules`, or $UCX_MODULES), the transport keeps UCX from loading its EFA
module (`UCX_MODULES=^efa`), which avoids the crash; EFA is an AWS fabric that
NIXL reaches through its LIBFABRIC backend anyway.

Ports: the agent runs no listener thread, and UCX's TCP transport listens on a port
the kernel assigns (it binds port 0 unless $UCX_TCP_PORT_RANGE says otherwise), so
engines starting at once cannot take each other's port, unlike Mooncake's random
pick (see the Mooncake transport).

Who can reach the engine's memory: UCX listens on an address of every network device it
uses (here 127.0.0.1 and the host's other address), not on one p2psync chooses: restrict it
with `ucx_net_devices` (or $UCX_NET_DEVICES). The agent metadata the table publishes (and
any process may read from the rendezvous) carries what a remote agent needs to write into
the registered memory, with no token; on one host UCX writes by cma (process_vm_writev), as
the engine's user. This transport cannot conceal the memory between updates (re-registering
would give new keys that every trainer must load again, and cma ignores registrations): the
endpoint verifies the weights while it serves instead (`EngineEndpoint`, `verify_seconds`).
"""

from __future__ import annotations

import base64
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ...core.errors import TransferError, TransferTimeout
from ...core.transport import Peer, Transport, WriteBatch
from ...core.types import TargetTable
from .agent import MEMORY_TYPES, NIXL_MODULE, PY_LEVELS, load_nixl, memory_of, region_of, ucx_environment
from .options import NixlOptions

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: The notification a trainer sends as it writes, and how often at most (seconds).
KICK = b"p2psync:writing"
KICK_EVERY = 0.25


class NixlTransport(Transport):
    """NIXL over UCX (or another NIXL backend that supports WRITE); options: `NixlOptions`."""

    name = "nixl"
    devices = ("cpu", "cuda")
    requires = (NIXL_MODULE,)
    Options = NixlOptions

    def __init__(self, *, options: Mapping[str, Any] | NixlOptions | None = None) -> None:
        super().__init__(options=options)
        opts: NixlOptions = self.options
        self.backend = opts.backend
        params = {str(k): str(v) for k, v in opts.backend_params.items()}
        if opts.ucx_net_devices:
            params["ucx_devices"] = opts.ucx_net_devices
        self.backend_params = params
        self.environment: dict[str, str] = {}
        if opts.ucx_tls:
            self.environment["UCX_TLS"] = opts.ucx_tls
        modules = opts.ucx_modules
        if modules is None and "UCX_MODULES" not in os.environ:
            modules = "^efa"
        if modules:
            self.environment["UCX_MODULES"] = modules
        self.memory = opts.memory.upper()
        self.progress_interval = opts.progress_interval
        self.busy_progress_interval = opts.busy_progress_interval
        self.busy_window = opts.busy_window
        self.log_level = opts.log_level

        self._agent: Any = None
        self._closed = False
        self._agent_name = f"p2psync-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._lock = threading.Lock()  # guards the bookkeeping below, not NIXL (thread-safe: STRICT)
        self._registered: dict[int, Any] = {}  # address -> nixlRegDList, for deregistration
        self._local: tuple[str, int] | None = None  # memory type and device of the trainer buffers
        self._remotes: dict[str, int] = {}  # loaded remote agents -> open peers
        self._abandoned: list[Any] = []  # transfer handles NIXL would not release (still in flight)
        self._progress_stop = threading.Event()
        self._progress_thread: threading.Thread | None = None

    # -- the agent ---------------------------------------------------------

    @property
    def agent(self) -> Any:
        if self._closed:
            raise TransferError(f"the NIXL transport of agent {self._agent_name!r} is closed")
        if self._agent is None:
            if "NIXL_LOG_LEVEL" not in os.environ:
                os.environ["NIXL_LOG_LEVEL"] = self.log_level  # read by NIXL's C++ side when it loads
                # and by its Python logger at import, which may have happened already
                logging.getLogger("nixl").setLevel(PY_LEVELS.get(self.log_level.upper(), logging.WARNING))
            nixl = load_nixl()
            config = nixl.nixl_agent_config(
                # The agent's own progress thread polls UCX with no pause at all (the
                # Python API gives it a delay of 0): on small machines it eats a core
                # and slows transfers 1.5-3x. Progress is made by polling instead (the
                # trainer) and by `_progress_loop` (the engine).
                enable_prog_thread=False,
                enable_listen_thread=False,
                backends=[],
                # Writes to several engines run on several threads, and the engine side
                # progresses from its own thread: NIXL must lock (NONE locks nothing).
                sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
            )
            with ucx_environment(self.environment):
                agent = nixl.nixl_agent(self._agent_name, config)
                if self.backend not in agent.get_plugin_list():
                    raise TransferError(
                        f"NIXL has no {self.backend!r} backend plugin (available: {', '.join(agent.get_plugin_list())})"
                    )
                try:
                    agent.create_backend(self.backend, self.backend_params)
                except Exception as exc:
                    raise TransferError(
                        f"NIXL could not create its {self.backend} backend with {self.backend_params} "
                        f"and {self.environment or 'the default UCX environment'}: {type(exc).__name__}: {exc}"
                    ) from exc
            self._agent = agent
        return self._agent

    def _register(self, tensors: Sequence[torch.Tensor]) -> tuple[str, int]:
        """Register tensors that share one memory type and device; return those."""
        kinds = {memory_of(t) for t in tensors}
        if len(kinds) > 1:
            raise TransferError(f"NIXL transport: tensors on several devices at once: {sorted(kinds)}")
        kind = kinds.pop()
        if self.memory != "AUTO" and kind[0] != self.memory:
            raise TransferError(f"NIXL transport option memory={self.memory!r}, but a tensor is in {kind[0]}")
        regions = [region_of(t) for t in tensors]
        agent = self.agent
        for addr, nbytes in regions:
            try:
                descs = agent.register_memory([(addr, nbytes, kind[1], "")], kind[0], backends=[self.backend])
            except Exception as exc:
                raise TransferError(
                    f"NIXL register_memory({addr:#x}, {nbytes}, {kind[0]}) failed: {type(exc).__name__}: {exc}"
                ) from exc
            with self._lock:
                self._registered[addr] = descs
        return kind

    def _deregister(self, addr: int) -> None:
        with self._lock:
            descs = self._registered.pop(addr, None)
        if descs is not None and self._agent is not None:
            try:
                self._agent.deregister_memory(descs, backends=[self.backend])
            except Exception as exc:  # close() must go on releasing the rest
                log.warning("NIXL deregister_memory(%#x) failed: %s", addr, exc)

    # -- engine side -------------------------------------------------------

    def expose(self, tensors: Sequence[torch.Tensor]) -> dict[str, Any]:
        memory, device = self._register(tensors) if tensors else ("DRAM", 0)
        metadata = self.agent.get_agent_metadata()
        self._start_progress()
        return {
            "agent": self._agent_name,
            "metadata": base64.b64encode(metadata).decode("ascii"),
            "backend": self.backend,
            "memory": memory,
            "device_id": device,
            "host": socket.gethostname(),
        }

    def _start_progress(self) -> None:
        if self._progress_thread is None:
            self._progress_stop.clear()
            self._progress_thread = threading.Thread(
                target=self._progress_loop, name=f"p2psync-nixl-progress-{self._agent_name}", daemon=True
            )
            self._progress_thread.start()

    def _progress_loop(self) -> None:
        """Drive the engine side's UCX worker while the process runs no p2psync code.

        The engine side is passive: trainers write into its memory and it runs no
        per-update code. But UCX needs the target's worker to make progress. Seen
        here with UCX 1.23 (nixl-cu12 1.5.1), agents without a progress thread:
        over the default transports, a first WRITE lands its bytes (cma) but never
        completes on the trainer, because the connection's wire-up messages go to
        the target, which must answer; over UCX_TLS=tcp the puts themselves are
        active messages the target must receive, so not even the bytes land, and
        throughput follows the polling rate (1 GiB loopback: 0.8 GB/s polling every
        10 ms, 2 GB/s every 1 ms, 3 GB/s every 0.1 ms). The agent's own progress
        thread would do it, but spins (see `agent`).

        So this thread calls `get_new_notifs()`, which progresses the UCX workers:
        every `progress_interval` seconds while idle, and every
        `busy_progress_interval` for `busy_window` seconds after a trainer's
        notification (`NixlPeer` sends one as it starts writing, and again during
        long writes), so that polling fast costs nothing between updates (when the
        engine serves requests) and only during them (when it is paused).
        """
        failures = 0
        busy_until = 0.0
        while True:
            now = time.monotonic()
            interval = self.busy_progress_interval if now < busy_until else self.progress_interval
            if self._progress_stop.wait(interval):
                return
            agent = self._agent
            if agent is None:
                continue
            try:
                if agent.get_new_notifs():
                    busy_until = time.monotonic() + self.busy_window
                failures = 0
            except Exception as exc:
                failures += 1
                if failures == 1:
                    log.warning("NIXL progress on %s failed: %s", self._agent_name, exc)
                self._progress_stop.wait(min(1.0, self.progress_interval * 2**failures))

    # -- trainer side ------------------------------------------------------

    def register_buffer(self, buffer: torch.Tensor) -> None:
        kind = memory_of(buffer)
        with self._lock:
            if self._local is not None and self._local != kind:
                raise TransferError(
                    f"NIXL transport: transfer buffers on several devices: {self._local} and {kind}"
                )
        self._register([buffer])
        with self._lock:
            self._local = kind

    def unregister_buffer(self, buffer: torch.Tensor) -> None:
        self._deregister(buffer.data_ptr())

    def open(self, table: TargetTable) -> Peer:
        where = f"engine {table.engine_id!r} rank {table.rank}"
        info = table.transport_info
        name, metadata = info.get("agent"), info.get("metadata")
        if not isinstance(name, str) or not isinstance(metadata, str):
            raise TransferError(f"{where} published no NIXL agent name and metadata")
        memory, device = str(info.get("memory", "DRAM")), int(info.get("device_id", 0))
        if memory not in MEMORY_TYPES:
            raise TransferError(f"{where} published NIXL memory type {memory!r}")
        if info.get("backend", self.backend) != self.backend:
            raise TransferError(f"{where} exposed its memory to NIXL backend {info['backend']!r}, not {self.backend!r}")
        agent = self.agent
        with self._lock:
            loaded = name in self._remotes
            if not loaded:
                try:
                    got = agent.add_remote_agent(base64.b64decode(metadata))
                except Exception as exc:
                    raise TransferError(
                        f"NIXL could not load the metadata of {where} (agent {name!r}): {type(exc).__name__}: {exc}"
                    ) from exc
                if isinstance(got, bytes):
                    got = got.decode()
                if got != name:
                    agent.remove_remote_agent(got)
                    raise TransferError(f"{where} published agent {name!r}, but its metadata names {got!r}")
            self._remotes[name] = self._remotes.get(name, 0) + 1
        return NixlPeer(self, name, where, remote=(memory, device))

    def _release_peer(self, name: str) -> None:
        with self._lock:
            left = self._remotes.get(name, 0) - 1
            if left > 0:
                self._remotes[name] = left
                return
            self._remotes.pop(name, None)
        self._retry_abandoned()
        if self._agent is not None:
            try:
                self._agent.remove_remote_agent(name)
            except Exception as exc:
                log.debug("NIXL remove_remote_agent(%s): %s", name, exc)

    def _abandon(self, handle: Any) -> None:
        with self._lock:
            self._abandoned.append(handle)

    def _retry_abandoned(self) -> None:
        with self._lock:
            handles, self._abandoned = self._abandoned, []
        kept = []
        for handle in handles:
            try:
                handle.release()
            except Exception:
                kept.append(handle)
        if kept:
            with self._lock:
                self._abandoned.extend(kept)

    # -- both --------------------------------------------------------------

    def close(self) -> None:
        self._progress_stop.set()
        if self._progress_thread is not None:
            self._progress_thread.join(timeout=5)
            self._progress_thread = None
        self._closed = True
        if self._agent is None:
            return
        self._retry_abandoned()
        if self._abandoned:
            # Still in flight: keep the handles, the registrations and the agent alive
            # rather than let UCX touch memory it no longer owns.
            log.warning("NIXL: %d write(s) could not be released; keeping the agent", len(self._abandoned))
            return
        with self._lock:
            remotes, self._remotes = list(self._remotes), {}
        for name in remotes:
            try:
                self._agent.remove_remote_agent(name)
            except Exception as exc:
                log.debug("NIXL remove_remote_agent(%s): %s", name, exc)
        for addr in list(self._registered):
            self._deregister(addr)
        self._local = None
        self._agent = None  # the agent and its backend are destroyed with the object

    def describe(self) -> dict[str, Any]:
        return {
            "transport": self.name,
            "backend": self.backend,
            "agent": self._agent_name,
            "backend_params": dict(self.backend_params),
            "ucx_tls": self.environment.get("UCX_TLS") or os.environ.get("UCX_TLS") or "default",
            "ucx_modules": self.environment.get("UCX_MODULES") or os.environ.get("UCX_MODULES") or "all",
            "memory": self.memory.lower() if self.memory == "AUTO" else self.memory,
        }


class NixlPeer(Peer):
    """One engine rank's agent: each write is one NIXL WRITE request, polled until
    done, failed or late."""

    def __init__(self, transport: NixlTransport, name: str, where: str, *, remote: tuple[str, int]) -> None:
        self.transport = transport
        self.remote_agent = name
        self.where = where
        self.remote = remote  # memory type and device id of the engine's parameters
        self._closed = False
        self._kicked = 0.0

    def _kick(self, agent: Any) -> None:
        """Tell the engine side that writes are under way, so that it polls fast."""
        now = time.monotonic()
        if now - self._kicked < KICK_EVERY:
            return
        self._kicked = now
        try:
            agent.send_notif(self.remote_agent, KICK)
        except Exception as exc:  # the write itself reports a dead peer
            log.debug("NIXL notification to %s failed: %s", self.where, exc)

    def _descs(self, agent: Any, addrs: list[int], lengths: list[int], memory: tuple[str, int]) -> Any:
        import numpy as np

        rows = np.empty((len(addrs), 3), dtype=np.uint64)
        rows[:, 0] = addrs
        rows[:, 1] = lengths
        rows[:, 2] = memory[1]
        return agent.get_xfer_descs(rows, memory[0])

    def write(self, batch: WriteBatch, *, timeout: float) -> None:
        if not batch.lengths:
            return
        if self._closed:
            raise TransferError(f"write to {self.where}: the NIXL peer is closed")
        deadline = time.monotonic() + timeout
        agent = self.transport.agent
        if self.transport._abandoned:
            self.transport._retry_abandoned()
        what = f"NIXL write of {batch.nbytes} bytes in {len(batch)} ranges to {self.where} (agent {self.remote_agent})"
        try:
            local = self._descs(agent, batch.local, batch.lengths, self.transport._local or ("DRAM", 0))
            remote = self._descs(agent, batch.remote, batch.lengths, self.remote)
            handle = agent.initialize_xfer("WRITE", local, remote, self.remote_agent)
        except Exception as exc:
            raise TransferError(f"{what} could not start: {type(exc).__name__}: {exc}") from exc
        try:
            self._kick(agent)
            state = agent.transfer(handle)
            pause = 50e-6
            while state == "PROC":
                if time.monotonic() > deadline:
                    self._drop(handle)
                    raise TransferTimeout(f"{what} not done after {timeout:.1f} s")
                self._kick(agent)
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
                state = agent.check_xfer_state(handle)
        except TransferError:
            raise
        except Exception as exc:
            self._drop(handle)
            raise TransferError(f"{what} failed: {type(exc).__name__}: {exc}") from exc
        self._drop(handle)
        if state != "DONE":
            raise TransferError(f"{what} failed (NIXL state {state})")

    def _drop(self, handle: Any) -> None:
        """Release a request; one still in flight that NIXL cannot cancel is kept
        until the transport can release it (its memory stays registered till then)."""
        try:
            handle.release()
        except Exception as exc:
            log.warning("NIXL could not release a request to %s (%s); abandoning it", self.where, exc)
            self.transport._abandon(handle)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.transport._release_peer(self.remote_agent)
