"""Engine side of sglang: expose one rank's parameters to trainers from inside its process."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...engine.endpoint import EndpointOptions, EngineEndpoint, EngineHooks
from ...core.transport import Transport
from .key import fp8_config, layout_key
from .shim import TargetAndDraft, fp8_post_load_settings, hf_config_dict, post_load

if TYPE_CHECKING:
    from typing import Unpack

    import torch

    from ...core.rendezvous import Rendezvous


def serve(
    model: torch.nn.Module,
    server_args: Any,
    model_config: Any,
    *,
    engine_id: str,
    rank: int,
    rendezvous: Rendezvous,
    transport: Transport | str,
    draft: torch.nn.Module | None = None,
    **options: Unpack[EndpointOptions],
) -> EngineEndpoint:
    """Register the rank's parameters (sglang names, live memory), publish its table, serve control calls.

    `server_args` and `model_config` are sglang's ServerArgs and ModelConfig of the
    engine; they make the layout key, from which a trainer rebuilds this rank.
    `draft`: the rank's speculative draft model (sglang's MTP/NextN draft worker's, its
    embedding and LM head already the target's): its parameters are published too, under
    `draft.`, so that one update writes and checks both (see `shim.TargetAndDraft`).
    By default `finish` runs sglang's post-load step (see `shim.post_load`). `options`:
    see `EndpointOptions` (`extra`: the server's URL, when serving inside one).
    """
    if draft is not None:
        model = TargetAndDraft(model, draft)
    if options.get("hooks") is None:
        options["hooks"] = EngineHooks(post_process=lambda: post_load(model))  # the draft's too
    return EngineEndpoint.serve(
        engine="sglang",
        engine_id=engine_id,
        rank=rank,
        world_size=int(server_args.tp_size),
        params={name: p.data for name, p in model.named_parameters()},
        layout_key=rank_key(server_args, model_config, draft_published=draft is not None),
        transport=transport,
        rendezvous=rendezvous,
        **options,
    )


def rank_key(server_args: Any, model_config: Any, *, draft_published: bool = False) -> dict[str, Any]:
    """The layout key a rank of this engine publishes (`key.layout_key`), from sglang's ServerArgs
    and ModelConfig; fp8's post-load settings are read in this process, as the engine's own."""
    import sglang

    hf_config = hf_config_dict(model_config)
    fp8_post_load = fp8_post_load_settings() if fp8_config(hf_config) else None
    return layout_key(
        server_args, hf_config, str(model_config.dtype), sglang.__version__, fp8_post_load,
        draft_published=draft_published,
    )
