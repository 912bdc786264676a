"""`process_vm_writev` through ctypes: copy a WriteBatch into another process's memory.

One syscall moves up to IOV_MAX ranges; calls are capped at CALL_BYTES so the
deadline is checked often even for a single huge range. The kernel may stop
early (a partial write), so every call resumes exactly where the last one ended.
`read_u64` reads one word back (process_vm_readv), to see whether the engine
still has its memory exposed.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import time
from collections.abc import Callable

from ...core.errors import TransferError, TransferTimeout
from ...core.transport import WriteBatch
from .host import ptrace_advice

IOV_MAX = 1024
CALL_BYTES = 64 << 20


class IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


@functools.cache
def _syscall(name: str) -> Callable[..., int]:
    fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    iov = ctypes.POINTER(IoVec)
    fn.argtypes = [ctypes.c_int, iov, ctypes.c_ulong, iov, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_ssize_t
    return fn


def _segments(batch: WriteBatch) -> list[tuple[int, int, int]]:
    """(local, remote, length) of every range, split to at most CALL_BYTES each."""
    out = []
    for local, remote, length in zip(batch.local, batch.remote, batch.lengths):
        for offset in range(0, length, CALL_BYTES):
            out.append((local + offset, remote + offset, min(CALL_BYTES, length - offset)))
    return out


def _explain(code: int, pid: int) -> str:
    if code == errno.EPERM:
        return f"process_vm_writev/readv on pid {pid} refused (EPERM): {ptrace_advice()}"
    if code == errno.ESRCH:
        return f"engine process {pid} is gone (ESRCH)"
    if code == errno.EFAULT:
        return f"an address is not mapped in this process or in engine process {pid} (EFAULT; a stale target table?)"
    return f"process_vm_writev into pid {pid} failed: {errno.errorcode.get(code, code)} {os.strerror(code)}"


def write(pid: int, batch: WriteBatch, *, deadline: float, who: str, check: Callable[[], None]) -> None:
    """Write every range of `batch` into process `pid`, by `deadline` (time.monotonic).

    `check()` runs before each call and raises if `pid` no longer is the engine.
    Errors name `who`.
    """
    segments = _segments(batch)
    index, done = 0, 0  # next segment, bytes of it already written
    while index < len(segments):
        if time.monotonic() > deadline:
            written = sum(s[2] for s in segments[:index]) + done
            raise TransferTimeout(f"{who}: {written} of {batch.nbytes} bytes written when the time ran out")
        check()
        count, nbytes = 0, 0
        while index + count < len(segments) and count < IOV_MAX:
            length = segments[index + count][2]
            if count and nbytes + length > CALL_BYTES:
                break
            nbytes, count = nbytes + length, count + 1
        local, remote = (IoVec * count)(), (IoVec * count)()
        for k, (src, dst, length) in enumerate(segments[index : index + count]):
            skip = done if k == 0 else 0
            local[k] = IoVec(src + skip, length - skip)
            remote[k] = IoVec(dst + skip, length - skip)
        moved = _syscall("process_vm_writev")(pid, local, count, remote, count, 0)
        if moved < 0:
            raise TransferError(f"{who}: {_explain(ctypes.get_errno(), pid)}")
        if moved == 0:
            raise TransferError(f"{who}: process_vm_writev into pid {pid} wrote nothing")
        while moved > 0:
            left = segments[index][2] - done
            if moved < left:
                done += moved
                break
            moved -= left
            index, done = index + 1, 0


def read_u64(pid: int, addr: int, *, who: str) -> int:
    """The 8-byte word at `addr` in process `pid` (process_vm_readv)."""
    word = ctypes.c_uint64()
    local = (IoVec * 1)(IoVec(ctypes.addressof(word), 8))
    remote = (IoVec * 1)(IoVec(addr, 8))
    if _syscall("process_vm_readv")(pid, local, 1, remote, 1, 0) != 8:
        raise TransferError(f"{who}: {_explain(ctypes.get_errno(), pid)}")
    return word.value
