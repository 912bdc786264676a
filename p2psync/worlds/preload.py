"""What the fork server of `processes` imports once, before it forks a world's processes.

A module that does not import here (not installed, or broken) is passed over: a process that
needs it imports it itself, and fails there naming why.
"""

from __future__ import annotations

import importlib

from .processes import PRELOAD

for _module in PRELOAD:
    try:
        importlib.import_module(_module)
    except Exception:  # noqa: BLE001, S110 - see above
        pass
