"""Engine side of the torch engine: expose a module's parameters to trainers."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from ...engine.endpoint import EndpointOptions, EngineEndpoint
from ...core.transport import Transport

if TYPE_CHECKING:
    from typing import Unpack

    import torch

    from ...core.rendezvous import Rendezvous


def serve(
    module: torch.nn.Module,
    *,
    engine_id: str,
    rendezvous: Rendezvous,
    transport: Transport | str,
    rank: int = 0,
    world_size: int = 1,
    name_map: Callable[[str], str] | Mapping[str, str] | None = None,
    select: Callable[[str], bool] | None = None,
    **options: Unpack[EndpointOptions],
) -> EngineEndpoint:
    """Register `module`'s parameters, publish its table and serve control calls.

    The module serves (its `hooks.routes`) only weights of a known version: `version`
    declares the one it holds now, else it waits for its first update. `options`: see
    `EndpointOptions` (control calls must carry `token`, default the rendezvous's).

    A `load_state_dict` of `module` tells the endpoint that its weights were written outside
    p2psync (the next delta update sends them in full). Parameters are published under their HF names: `name_map` turns a module
    parameter name into one (a mapping or a function; identity by default). The
    layout key is a digest of every name, shape and dtype, so engines built from
    the same model class and config share one layout. `select` publishes only the
    parameters whose module name it accepts (a LoRA adapter's, say).
    """
    rename = name_map.__getitem__ if isinstance(name_map, Mapping) else (name_map or (lambda n: n))
    params = {rename(name): p.data for name, p in module.named_parameters() if select is None or select(name)}
    fingerprint = hashlib.sha256(
        repr(sorted((n, tuple(t.shape), str(t.dtype)) for n, t in params.items())).encode()
    ).hexdigest()[:16]
    endpoint = EngineEndpoint.serve(
        engine="torch",
        engine_id=engine_id,
        rank=rank,
        world_size=world_size,
        params=params,
        layout_key={"params": fingerprint},
        transport=transport,
        rendezvous=rendezvous,
        **options,
    )
    # a load_state_dict of the served module writes its weights outside p2psync
    module.register_load_state_dict_post_hook(lambda *_: endpoint.weights_written("load_state_dict"))
    return endpoint
