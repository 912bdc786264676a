"""sglang general plugin (entry point group `sglang.srt.plugins`): runs in every sglang process.

It lets a real sglang server on CPU publish weight memory that Mooncake accepts
writes into (see `shim.patch_server_for_cpu`); on GPUs it does nothing.
"""

from __future__ import annotations


def load() -> None:
    from .shim import patch_server_for_cpu

    patch_server_for_cpu()
