"""Same-host transport on CPU: process_vm_writev into an engine rank in its own process."""

from __future__ import annotations

import ctypes
import os
import signal
import time

import pytest
import torch
from tests.helpers.transport import ENGINE_ID, assert_same, engine, expected_after, multi_range_batch

from p2psync.core.errors import TransferError
from p2psync.core.transport import WriteBatch
from p2psync.core.types import TargetParam, TargetTable
from p2psync.transports.samehost import vm
from p2psync.transports.samehost.transport import SameHostTransport

WHO = f"engine '{ENGINE_ID}' rank 0"


def trainer(buffer: torch.Tensor) -> SameHostTransport:
    side = SameHostTransport()
    side.register_buffer(buffer)
    return side


def test_writes_land_bit_for_bit_even_while_the_engine_is_stopped():
    buffer = torch.randint(0, 256, (2 << 20,), dtype=torch.uint8)
    with engine("samehost", "samehost-exact") as (eng, _):
        peer = trainer(buffer).open(eng.table)
        batch = multi_range_batch(eng.table, buffer)
        assert len(batch) > vm.IOV_MAX
        before = eng.dump()
        peer.write(batch, timeout=10)
        expected = expected_after(eng.table, before, batch, buffer)
        assert_same(eng.dump(), expected)

        buffer.random_(0, 256)  # one-sided: a stopped engine still receives
        eng.signal(signal.SIGSTOP)
        peer.write(batch, timeout=10)
        eng.signal(signal.SIGCONT)
        assert_same(eng.dump(), expected_after(eng.table, expected, batch, buffer))


def test_a_dead_engine_fails_at_once_naming_it():
    buffer = torch.ones(2 << 20, dtype=torch.uint8)
    with engine("samehost", "samehost-dead") as (eng, _):
        peer = trainer(buffer).open(eng.table)
        eng.kill()
        start = time.monotonic()
        with pytest.raises(TransferError, match=f"{WHO}: engine process {eng.proc.pid} has exited"):
            peer.write(multi_range_batch(eng.table, buffer), timeout=5)
        assert time.monotonic() - start < 1


def this_process_table(transport: SameHostTransport, tensor: torch.Tensor, **host: str) -> TargetTable:
    """A table of `tensor`, exposed by this process (with `host` identity fields overridden)."""
    info = transport.expose([tensor])
    info["host"].update(host)
    param = TargetParam(
        "p", tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), tensor.data_ptr(), tensor.nbytes
    )
    return TargetTable(
        engine_id=ENGINE_ID,
        rank=0,
        world_size=1,
        engine="torch",
        layout_key={},
        transport="samehost",
        transport_info=info,
        control_url="",
        params=(param,),
    )


def test_an_engine_on_another_host_is_refused_at_open():
    side = SameHostTransport()
    table = this_process_table(side, torch.zeros(8), boot_id="another-boot")
    with pytest.raises(TransferError, match="runs on host .*samehost reaches engines on its own host only"):
        side.open(table)


def test_an_engine_that_closed_its_transport_is_not_written():
    side, param = SameHostTransport(), torch.zeros(64, dtype=torch.uint8)
    table = this_process_table(side, param)
    buffer = torch.ones(64, dtype=torch.uint8)
    peer = trainer(buffer).open(table)
    side.close()
    batch = WriteBatch()
    batch.add(buffer.data_ptr(), param.data_ptr(), 64)
    with pytest.raises(TransferError, match="closed its samehost transport"):
        peer.write(batch, timeout=5)
    assert not param.any()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to write as another user")
def test_eperm_explains_ptrace():
    target = ctypes.create_string_buffer(8)
    source = ctypes.create_string_buffer(b"x" * 8, 8)
    batch = WriteBatch()
    batch.add(ctypes.addressof(source), ctypes.addressof(target), 8)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a trainer of another user, writing into this process
        try:
            os.setuid(65534)
            vm.write(os.getppid(), batch, deadline=time.monotonic() + 5, who=WHO, check=lambda: None)
            message = "written"
        except TransferError as exc:
            message = str(exc)
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    message = os.read(read, 4096).decode()
    assert "EPERM" in message and "ptrace_scope" in message and WHO in message, message
    assert target.raw == bytes(8)


def test_a_partial_write_is_resumed_up_to_the_bad_range():
    source, target = torch.arange(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    batch = WriteBatch()
    batch.add(source.data_ptr(), target.data_ptr(), 32)
    batch.add(source.data_ptr() + 32, 4096, 32)  # unmapped: the kernel stops after the first range
    with pytest.raises(TransferError, match=f"{WHO}: an address is not mapped .*EFAULT"):
        vm.write(os.getpid(), batch, deadline=time.monotonic() + 5, who=WHO, check=lambda: None)
    assert torch.equal(target[:32], source[:32]) and not target[32:].any()
