"""sglang general plugin (entry point group `sglang.srt.plugins`): runs in every sglang process.

- On CPU it lets a real server publish weight memory that Mooncake accepts writes
  into (see `shim.patch_server_for_cpu`).
- With `P2PSYNC_SGLANG_ENDPOINT` set (JSON: `rendezvous` "host:port", or "ray" for the job's
  rendezvous actor, `job_id`, `engine_id` (a template such as "rollout-{replica}" takes each
  replica's id from its place in the job: `p2psync.core.identity`), optional `transport`,
  default "mooncake", optional `version` of the weights the server loads, optional
  `incarnation`, optional `server_url`: see below), each scheduler, once its model is
  loaded (and its MTP/EAGLE draft worker, if it runs one: the draft's parameters are
  published too), serves p2psync's endpoint over the rank's parameters and publishes its table
  in the rendezvous: for transports sglang does not publish for itself (NIXL) and for
  servers started without sglang's transfer-engine flag. Pausing, cache flushing and
  the weight version then go through the server's own HTTP API (see
  `target.SglangEngineTarget.control`) at `server_url`, by default the one its arguments
  name (`--host`, `--port`); the endpoints hold each update's lease and report an
  abandoned update (their status call). `"server_url": null` where the framework pauses
  and resumes the server around its updates and serves its HTTP API elsewhere (verl
  0.9: its server actor serves sglang's app on a port of its own, not `--port`): the
  trainer then pauses the ranks' endpoints only.
- With `"lora": true` as well, each scheduler serves every LoRA adapter its server holds
  (`--enable-lora`, `--lora-paths name=path`) as an adapter slot of its own, engine id
  `<engine_id>/<name>` (see `lora.serve_lora`): an update lands in the slot's staging copy
  while requests keep running, and is applied on the scheduler's thread between two forward
  passes (at the top of its event loop). Such a server must run with `--disable-radix-cache`.
- The server's main process settles the settings first: it fills in the engine id's template
  and, under Ray, finds the job's rendezvous actor (its schedulers, started after it, are no
  Ray processes), and hands both to its schedulers through their environment, with the job's
  token. Every scheduler waits for the rendezvous as long as it takes.
- Unless `version` is declared, the server holds weights of no known version: it pauses
  generation as soon as it is up (after sglang's own warm-up request), and the first
  update resumes it.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

ENDPOINT_ENV = "P2PSYNC_SGLANG_ENDPOINT"
#: Endpoints served by this process, kept alive for its lifetime.
_served: list[Any] = []


def load() -> None:
    import sglang

    from .shim import SGLANG_VERSION, on_model_loaded, patch_server_for_cpu

    if sglang.__version__ != SGLANG_VERSION and not os.environ.get(ENDPOINT_ENV):
        # Installed beside another sglang: stay out of its way rather than fail its server.
        log.warning("p2psync supports sglang %s, not %s: its sglang plugin does nothing", SGLANG_VERSION, sglang.__version__)
        return
    patch_server_for_cpu()
    if os.environ.get(ENDPOINT_ENV):
        if multiprocessing.parent_process() is None:
            _settle_settings()
        on_model_loaded(_serve_rank)
        if _settings().get("lora"):
            _serve_lora_slots()
        if _settings().get("version") is None and multiprocessing.parent_process() is None:
            _pause_once_up()  # the server's main process (HTTP server and tokenizer manager)


def _settings() -> dict[str, Any]:
    return json.loads(os.environ[ENDPOINT_ENV])


def _settle_settings() -> None:
    """In the server's main process: the engine id's template filled in from this process's
    place in the job, and the rendezvous "ray" found, for the schedulers it starts."""
    from ...core.identity import expand_engine_id

    settings = _settings()
    settings["engine_id"] = expand_engine_id(settings["engine_id"])
    if settings["rendezvous"] == "ray":
        from ..ray import job_rendezvous

        found = job_rendezvous(settings["job_id"])  # sets $P2PSYNC_TOKEN for the schedulers too
        settings["rendezvous"] = f"{found.host}:{found.port}"
    os.environ[ENDPOINT_ENV] = json.dumps(settings)
    log.info("p2psync: this server is engine %r of job %r, rendezvous at %s", settings["engine_id"],
             settings["job_id"], settings["rendezvous"])


def _rendezvous(settings: dict[str, Any]) -> Any:
    """A scheduler's client of the job's rendezvous: patient, since engines outlive trainers."""
    from ..ray import rendezvous_at

    return rendezvous_at(settings["rendezvous"], job_id=settings["job_id"], patient=True)


def _serve_rank(model: Any, server_args: Any, model_config: Any, tp_rank: int, draft: Any) -> None:
    from .endpoint import serve

    settings = _settings()
    declared = settings.get("version")
    if declared is not None and getattr(server_args, "weight_version", declared) != declared:
        log.warning("p2psync: the server names its weights %r, p2psync %r: start it with --weight-version %s so that "
                    "responses name p2psync's versions until the first update", server_args.weight_version, declared,
                    declared)
    rendezvous = _rendezvous(settings)
    server_url = settings.get("server_url", f"http://{server_args.host}:{server_args.port}")
    _served.append(
        serve(
            model, server_args, model_config, engine_id=settings["engine_id"], rank=tp_rank,
            rendezvous=rendezvous, transport=settings.get("transport", "mooncake"),
            extra={"server_url": server_url} if server_url else None,
            version=settings.get("version"), incarnation=settings.get("incarnation"), draft=draft,
        )
    )


class _BetweenBatches:
    """Work handed to the scheduler's thread, run at the top of its event loop (between two
    forward passes; the loop turns while idle too)."""

    def __init__(self, timeout: float = 300.0) -> None:
        self._work: queue.Queue[tuple[Callable[[], None], threading.Event, list[BaseException]]] = queue.Queue()
        self.timeout = timeout
        self.scheduler: Any = None  # the process's scheduler, once its loop turned

    def run(self, fn: Callable[[], None]) -> None:
        done, errors = threading.Event(), []  # type: ignore[var-annotated]
        self._work.put((fn, done, errors))
        if not done.wait(self.timeout):
            raise TimeoutError(f"the sglang scheduler ran no loop iteration in {self.timeout:g} s")
        if errors:
            raise errors[0]

    def drain(self, scheduler: Any, *args: Any, **kwargs: Any) -> None:
        self.scheduler = scheduler
        while True:
            try:
                fn, done, errors = self._work.get_nowait()
            except queue.Empty:
                return
            try:
                fn()
            except BaseException as exc:  # handed back to the waiting endpoint
                errors.append(exc)
            finally:
                done.set()


def _serve_lora_slots() -> None:
    """Serve each scheduler's adapters once its LoRAManager holds them."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    between = _BetweenBatches()

    def after_lora_manager(result: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
        from sglang.srt.runtime_context import get_context, get_lora, get_parallel

        from .lora import LoraRank, SglangAdapterSlots
        from .lora_shim import LoraSettings
        from .shim import SglangRankModel

        if not runner.server_args.disable_radix_cache:
            raise ValueError(
                "p2psync's LoRA slots need --disable-radix-cache: after an update sglang's prefix cache would give "
                "new requests KV that the adapter's old bytes computed"
            )
        settings = _settings()
        lora = get_lora()
        rank_model = SglangRankModel(runner.model, get_context(), runner.server_args, runner.model_config)
        limits = LoraSettings(
            max_lora_rank=int(lora.max_lora_rank), target_modules=tuple(sorted(lora.lora_target_modules)),
            max_loras_per_batch=int(lora.max_loras_per_batch),
            max_loaded_loras=int(lora.max_loaded_loras or lora.max_loras_per_batch),
        )

        rank = LoraRank(rank_model, runner.lora_manager, get_parallel().tp_rank, limits, between.run)
        slots = SglangAdapterSlots(rank, rendezvous=_rendezvous(settings),
                                   transport=settings.get("transport", "mooncake"), prefix=f"{settings['engine_id']}/")
        for ref in list(runner.lora_manager.lora_refs.values()):
            slots.serve(ref.lora_name, version=settings.get("version"))
        _served.append(slots)
        return result

    HookRegistry.register("sglang.srt.model_executor.model_runner.ModelRunner.init_lora_manager", after_lora_manager,
                          HookType.AFTER)
    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.ingest_requests", between.drain, HookType.BEFORE)


def _pause_once_up() -> None:
    """Pause generation right after sglang's warm-up, before the server says it is ready
    to roll: its weights are of no known version until p2psync's first update, whose
    finish calls /continue_generation."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def around(original: Any, *args: Any, **kwargs: Any) -> Any:
        after_warmup = kwargs.get("post_warmup_callback")

        def pause_then_continue() -> None:
            from sglang.srt.entrypoints import http_server

            http_server._global_state.tokenizer_manager.is_pause = True
            log.warning("p2psync: weights of no known version; generation paused until the first update")
            if after_warmup is not None:
                after_warmup()

        kwargs["post_warmup_callback"] = pause_then_continue
        return original(*args, **kwargs)

    HookRegistry.register("sglang.srt.entrypoints.http_server._wait_and_warmup", around, HookType.AROUND)
