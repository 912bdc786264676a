"""Weight updaters for miles and slime that sync through p2psync.

Both frameworks build one updater per trainer rank in their Megatron actor
(`slime/backends/megatron_utils/actor.py`, `miles/backends/megatron_utils/actor.py`)
and call, on every rank, `connect_rollout_engines(...)` when the engine set
changes and `update_weights()` after each training step; the actor compares
`weight_version` with the engines'. The classes here keep those signatures:

- `P2PSyncUpdateWeight`: slime's and miles' (before its WeightUpdater refactor)
  `UpdateWeightFromDistributed(args, model, weights_getter, *, model_name,
  quantization_config)`, `connect_rollout_engines(rollout_engines,
  rollout_engine_lock, engine_gpu_counts=None, engine_gpu_offsets=None)`.
- `P2PSyncWeightUpdater`: miles' `WeightUpdater(args, model, *, weights_getter,
  model_name, quantization_config, iterator_factory, parallel_state, is_lora,
  lora_sync_config=None)`, `connect_rollout_engines(rollout_engines,
  engine_gpu_counts=None, engine_gpu_offsets=None)`, `pop_metrics()`.

Settings come from `args` attributes, else environment variables (which Ray
passes to the actors through its runtime env):

| args attribute            | environment             | default                      |
|---------------------------|-------------------------|------------------------------|
| p2psync_rendezvous        | P2PSYNC_RENDEZVOUS      | required: host:port or "ray" |
| p2psync_job_id            | P2PSYNC_JOB_ID          | "rl"                         |
| p2psync_transport         | P2PSYNC_TRANSPORT       | "mooncake"                   |
| p2psync_source            | P2PSYNC_SOURCE          | "megatron"                   |
| p2psync_engine_prefix     | P2PSYNC_ENGINE_PREFIX   | "rollout-"                   |
| p2psync_host_rendezvous   | P2PSYNC_HOST_RENDEZVOUS | true (rank 0 hosts)          |
| p2psync_check             | P2PSYNC_CHECK           | false                        |
| update_weight_buffer_size | -                       | bucket_bytes                 |

Rollout engine i must serve its parameters under engine id `<prefix><i>` (the
order of `rollout_engines`), or `args.p2psync_engine_ids` lists the ids.
The trainer source is the registered p2psync TrainerSource named by
`p2psync_source`, built from the actor's model (for Megatron the model chunk
list, producing the HF names of the architecture that `model_name` names and
`args.vocab_size` vocabulary rows; for single-module sources such as fsdp2 its
one chunk), or the `source=` argument.

Rollouts: the frameworks' generate functions append one version per sglang response
(`meta_info["weight_version"]`, the last) to `Sample.weight_versions`; a response in
flight across an update came from two or more. `record_weight_versions(sample,
meta_info)`, called there instead, records every one and the token spans of each.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ..adapters.sglang.versions import VersionSpan
    from ..core.report import UpdateReport
    from ..trainer.session import Session
    from ..core.source import TrainerSource

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class UpdaterSettings:
    """The updaters' settings, typed: each from `args.p2psync_<name>`, else `$P2PSYNC_<NAME>`
    (which Ray passes to the actors through its runtime env), else its default."""

    rendezvous: str | None = None
    job_id: str = "rl"
    transport: str = "mooncake"
    source: str = "megatron"
    engine_prefix: str = "rollout-"
    host_rendezvous: bool = True
    check: bool = False

    @classmethod
    def of(cls, args: Any) -> UpdaterSettings:
        values: dict[str, Any] = {}
        for f in fields(cls):
            value = getattr(args, f"p2psync_{f.name}", None)
            if value is None:
                value = os.environ.get(f"P2PSYNC_{f.name.upper()}")
            if value is None:
                continue
            if f.type == "bool" and isinstance(value, str):
                value = value.lower() not in ("0", "false", "no", "")
            values[f.name] = value
        return cls(**values)


def megatron_architecture(model_name: str | None) -> str:
    """The HF `model_type` whose names the Megatron source produces, from the actors' `model_name`:
    `type(hf_config).__name__.lower()` (`"qwen3moeconfig"`) unless `--model-name` overrides it."""
    from ..adapters.megatron import ARCHITECTURES

    key = (model_name or "").lower().removesuffix("config").replace("_", "").replace("-", "")
    for architecture in ARCHITECTURES:
        if architecture.replace("_", "") == key:
            return architecture
    raise ValueError(f"p2psync: no Megatron name table for model_name {model_name!r}; known: {sorted(ARCHITECTURES)}")


class P2PSyncUpdateWeight:
    """slime's / miles' updater interface over a p2psync Session (collective on every trainer rank)."""

    def __init__(
        self,
        args: Any,
        model: Sequence[torch.nn.Module] | torch.nn.Module,
        weights_getter: Callable[[], Mapping[str, torch.Tensor]] | None = None,
        *,
        model_name: str | None = None,
        quantization_config: dict[str, Any] | None = None,
        source: TrainerSource | None = None,
        **_: Any,
    ) -> None:
        if quantization_config:
            log.warning("p2psync: quantization_config is not applied by the trainer; the engine's layout decides the bytes")
        self.args = args
        self.settings = UpdaterSettings.of(args)
        self.model = model
        self.model_name = model_name
        self.quantization_config = quantization_config
        self.weights_getter = weights_getter
        self.weight_version = 0
        self.rollout_engines: Sequence[Any] | None = None
        self.last_report: UpdateReport | None = None
        self._source = source
        self._session: Session | None = None

    # -- the frameworks' interface -----------------------------------------------------

    def connect_rollout_engines(
        self,
        rollout_engines: Sequence[Any],
        rollout_engine_lock: Any = None,
        engine_gpu_counts: Sequence[int] | None = None,
        engine_gpu_offsets: Sequence[int] | None = None,
    ) -> None:
        """Connect (again) to the engines; collective. The lock is not needed: nothing is broadcast."""
        self.rollout_engines = rollout_engines
        session = self._ensure_session()
        session.connect(self.engine_ids(rollout_engines))
        # A label an engine served names those weights alone: an updater made anew (a restarted
        # trainer, slime's next updater) counts on from the newest version the engines serve.
        self.weight_version = max(self.weight_version, session.served_count())

    def update_weights(self) -> None:
        """Pause, write every engine rank's bytes, verify if asked, set the version, resume; collective."""
        if self._session is None:
            raise RuntimeError("update_weights before connect_rollout_engines")
        self.weight_version += 1
        report = self._session.update(str(self.weight_version))
        self.last_report = report
        if not report.ok:
            raise RuntimeError(f"p2psync update {self.weight_version} left engines stale: {report.format()}")

    def disconnect_rollout_engines(self) -> None:
        """slime calls this before offloading the trainer: close peers, buffers and the transport."""
        self.close()

    # -- helpers -----------------------------------------------------------------------

    def engine_ids(self, rollout_engines: Sequence[Any]) -> list[str]:
        ids = getattr(self.args, "p2psync_engine_ids", None)
        if ids is not None:
            if len(ids) != len(rollout_engines):
                raise ValueError(f"p2psync_engine_ids names {len(ids)} engines, the framework has {len(rollout_engines)}")
            return list(ids)
        prefix = self.settings.engine_prefix
        return [f"{prefix}{i}" for i in range(len(rollout_engines))]

    def _ensure_session(self) -> Session:
        if self._session is not None:
            return self._session
        from ..adapters.ray import rendezvous_at
        from ..trainer import collectives
        from ..core.plugins import registry
        from ..trainer.options import DEFAULT_BUCKET_BYTES, SessionOptions
        from ..trainer.session import Session

        settings = self.settings
        address = settings.rendezvous
        if not address:
            raise ValueError("p2psync: set args.p2psync_rendezvous or $P2PSYNC_RENDEZVOUS to host:port or 'ray'")
        rendezvous = rendezvous_at(
            address, job_id=settings.job_id, host_it=collectives.world_rank() == 0 and settings.host_rendezvous,
        )
        if self._source is None:
            self._source = self._build_source(registry().trainer_source(settings.source))
        options = SessionOptions(  # miles' and slime's arguments, as p2psync's options
            bucket_bytes=int(getattr(self.args, "update_weight_buffer_size", None) or DEFAULT_BUCKET_BYTES),
            check=settings.check,
        )
        self._session = Session(
            source=self._source, transport=settings.transport, rendezvous=rendezvous, options=options
        )
        return self._session

    def _build_source(self, cls: type[TrainerSource]) -> TrainerSource:
        """`cls` over the actor's model: Megatron takes the chunk list, the HF names of `model_name`
        and the unpadded vocabulary (`args.vocab_size`, set by the actor from the HF config)."""
        build: Callable[..., TrainerSource] = cls  # each kind of source has its own constructor
        if cls.name == "megatron":  # MegatronSource(model, architecture, *, vocab_size)
            vocab_size = getattr(self.args, "vocab_size", None)
            return build(self.model, megatron_architecture(self.model_name), vocab_size=vocab_size)
        model = self.model
        if isinstance(model, Sequence):
            (model,) = model  # single-module sources take the one model chunk
        return build(model)

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None


class P2PSyncWeightUpdater(P2PSyncUpdateWeight):
    """miles' `WeightUpdater` interface (connect without a lock; metrics per update)."""

    def __init__(
        self,
        args: Any,
        model: Sequence[torch.nn.Module] | torch.nn.Module,
        *,
        weights_getter: Callable[[], Mapping[str, torch.Tensor]] | None = None,
        model_name: str | None = None,
        quantization_config: dict[str, Any] | None = None,
        iterator_factory: Callable[..., Any] | None = None,
        parallel_state: Any = None,
        is_lora: bool = False,
        lora_sync_config: dict[str, Any] | None = None,
        source: TrainerSource | None = None,
    ) -> None:
        if is_lora:
            raise NotImplementedError("p2psync: LoRA adapter sync is not supported; sync merged weights")
        super().__init__(
            args, model, weights_getter, model_name=model_name, quantization_config=quantization_config, source=source
        )
        self.parallel_state = parallel_state

    def connect_rollout_engines(  # type: ignore[override]
        self,
        rollout_engines: Sequence[Any],
        engine_gpu_counts: Sequence[int] | None = None,
        engine_gpu_offsets: Sequence[int] | None = None,
    ) -> None:
        super().connect_rollout_engines(rollout_engines, None, engine_gpu_counts, engine_gpu_offsets)

    def pop_metrics(self) -> dict[str, float]:
        report, self.last_report = self.last_report, None
        if report is None:
            return {}
        return report.metrics()


#: slime shares the interface.
UpdateWeightFromP2PSync = P2PSyncUpdateWeight


def record_weight_versions(sample: Any, meta_info: Mapping[str, Any], *, offset: int = 0) -> list[VersionSpan]:
    """Record on a miles/slime `Sample` which versions produced one sglang response of it: each
    span's version appended to `sample.weight_versions` (the frameworks' staleness checks read
    it), and the spans, moved by `offset` (the sample's response tokens before this response,
    in a multi-turn rollout), appended to `sample.metadata["weight_version_spans"]` as
    [version, start, end]."""
    from dataclasses import replace

    from ..adapters.sglang.versions import version_spans

    spans = [replace(s, start=s.start + offset, end=s.end + offset) for s in version_spans(meta_info)]
    sample.weight_versions.extend(s.version for s in spans)
    sample.metadata.setdefault("weight_version_spans", []).extend([s.version, s.start, s.end] for s in spans)
    return spans
