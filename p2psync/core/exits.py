"""Closing what is still open when the interpreter exits.

A transport engine destroyed during the interpreter's teardown, with its threads still
running, ends the process by SIGABRT ("terminate called without an active exception",
seen of Mooncake's Transfer Engine in a trainer rank that returned without `close()`),
and a launcher then calls the whole job failed. Sessions and endpoints close at exit
instead, while the interpreter is whole; `close()` called by the user cancels that.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from typing import Protocol

log = logging.getLogger(__name__)


class Closable(Protocol):
    def close(self) -> None: ...


class CloseAtExit:
    """Calls `obj.close()` at interpreter exit unless `cancel()` came first; holds `obj`
    weakly, so that an object nobody holds any more is not kept alive for it."""

    def __init__(self, obj: Closable) -> None:
        self._ref = weakref.ref(obj)
        atexit.register(self._at_exit)

    def cancel(self) -> None:
        atexit.unregister(self._at_exit)

    def _at_exit(self) -> None:
        obj = self._ref()
        if obj is None:
            return
        try:
            obj.close()
        except Exception:  # noqa: BLE001 - the process is ending: say so, end cleanly
            log.warning("closing %s at exit failed", type(obj).__name__, exc_info=True)
