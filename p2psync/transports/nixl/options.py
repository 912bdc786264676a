"""The NIXL transport's options."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class NixlOptions:
    """Options of the NIXL transport.

    - `backend`: NIXL backend, default "UCX".
    - `backend_params`: passed to `create_backend` (values as strings), e.g.
      `{"ucx_error_handling_mode": "none"}`; see `nixl_agent.get_plugin_params`.
    - `ucx_net_devices`: UCX network devices, e.g. "lo" or "mlx5_0:1" (the UCX
      backend's `ucx_devices` parameter); default: all.
    - `ucx_tls`: UCX transports (UCX_TLS) for this agent; default: UCX's choice
      ($UCX_TLS when set). With "shm,self" or "cma,self" UCX has no transport able
      to report peer failures: add `backend_params={"ucx_error_handling_mode": "none"}`.
    - `ucx_modules`: UCX_MODULES for this agent, default "^efa" (see the module
      docstring) unless $UCX_MODULES is set; "" leaves UCX alone.
    - `memory`: "auto" (default: DRAM for host tensors, VRAM for CUDA tensors),
      or "DRAM"/"VRAM" to insist (a tensor elsewhere is an error).
    - `progress_interval`, `busy_progress_interval`, `busy_window`: seconds between
      the engine side's progress calls while idle (default 0.005) and while trainers
      write (default 0.0001), and how long after a trainer's notification writes
      count as under way (default 1.0); see `NixlTransport._progress_loop`.
    - `log_level`: NIXL's own log level (NIXL_LOG_LEVEL), default "WARN": at INFO it
      logs every agent and backend it creates; $NIXL_LOG_LEVEL wins when set.
    """

    backend: str = "UCX"
    backend_params: dict = field(default_factory=dict)
    ucx_net_devices: str | None = None
    ucx_tls: str | None = None
    ucx_modules: str | None = None
    memory: Literal["auto", "DRAM", "VRAM"] = "auto"
    progress_interval: float = 5e-3
    busy_progress_interval: float = 1e-4
    busy_window: float = 1.0
    log_level: str = "WARN"
