"""Patches that let verl 0.9.1 drive sglang 0.5.23 (CPU or GPU alike).

Why: version skew, not the CPU. verl 0.9.1 was written against sglang 0.5.12; sglang 0.5.23 (the version
p2psync's sglang plugin and its conformance environment use) changed three interfaces verl calls; a fourth
patch covers a port mismatch in verl itself that sglang 0.5.23 exposes. Each patch names the verl 0.9.1 /
sglang 0.5.23 file:line it works around. Drop a patch when verl catches up.

Installed in every Ray worker through ray.init(runtime_env={"worker_process_setup_hook":
"tests.verl_ray.compat.setup"}) and called in the driver. Patches on modules that import sglang are applied
right after that module's own import (a meta-path hook), so workers that never import sglang pay nothing.
"""

import dataclasses
import importlib.abc
import importlib.util
import sys

_orig_fields = dataclasses.fields


def _fields(class_or_instance):
    # verl async_sglang_server.py:375 `dataclasses.fields(ServerArgs)`: skew, sglang 0.5.23's ServerArgs
    # (sglang/srt/server_args.py:231) is no dataclass any more (0.5.12's was); its fields come from record_fields.
    try:
        return _orig_fields(class_or_instance)
    except TypeError:
        from sglang.srt.arg_groups.arg_utils import record_fields

        cls = class_or_instance if isinstance(class_or_instance, type) else type(class_or_instance)
        return record_fields(cls)


def _patch_http_server_engine(mod):
    # verl http_server_engine.py:199/577 HttpServerAdapter(EngineBase): skew, sglang 0.5.23's EngineBase
    # (sglang/srt/entrypoints/EngineBase.py:49,54) adds abstract begin/end_weight_update (0.5.12 had none), so
    # ServerAdapter._init_server_adapter (sglang_rollout.py:254) cannot instantiate it.
    for cls in (mod.HttpServerAdapter, mod.AsyncHttpServerAdapter):
        cls.__abstractmethods__ = frozenset()


async def _launch_server_on_free_port(self, *args, **kwargs):
    # verl async_sglang_server.py:477 serves sglang's app through run_uvicorn (rollout/utils.py:69,
    # port=0: a random port), while ServerArgs.port stays 30000 (a mismatch in verl itself, which hurts once
    # something reads server_args.port after launch; not the CPU). Whatever reads server_args.port then
    # dials a closed port: sglang's own warm-up thread (http_server.py:2561 /freeze_gc). (p2psync's server
    # plugin reads no port here: the job sets its "server_url" to null, as the frameworks guide says for verl.)
    # Stand-in: pick a free port per server before ServerArgs is built, and serve on it.
    import socket

    with socket.socket() as s:
        s.bind((self._server_address, 0))
        port = s.getsockname()[1]
    sg = self.config.engine_kwargs.setdefault("sglang", {})
    sg["port"] = port
    sg.setdefault("host", self._server_address)
    return await type(self)._verl_launch_server(self, *args, **kwargs)


async def _run_uvicorn_on_server_args_port(app, server_args, server_address):
    import asyncio

    import uvicorn

    app.server_args = server_args
    config = uvicorn.Config(app, host=server_address, port=server_args.port, log_level="warning")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            await task
        await asyncio.sleep(0.05)
    return server_args.port, task


_ORIG_LAUNCH_SUBPROCESSES = []


def _launch_subprocesses_verl_order(cls, *args, **kwargs):
    # verl async_sglang_server.py:430 unpacks `tokenizer_manager, template_manager, scheduler_info, *_`
    # from Engine._launch_subprocesses (skew: 0.5.12's order), whose third element is PortArgs in sglang 0.5.23
    # (sglang/srt/entrypoints/engine.py:1137-1143: tm, template, port_args, SchedulerInitResult, ...).
    # The PortArgs then lands in _GlobalState.scheduler_info and /server_info answers 500
    # (sglang/srt/utils/common.py:3591 `result.update(scheduler_info)`).  Put the dict verl expects there.
    out = _ORIG_LAUNCH_SUBPROCESSES[0](*args, **kwargs)
    if len(out) >= 4 and hasattr(out[3], "scheduler_infos"):
        tm, template, port_args, init_result, *rest = out
        return (tm, template, dict(init_result.scheduler_infos[0]), port_args, init_result, *rest)
    return out


def _patch_async_sglang_server(mod):
    # Functions stay picklable by reference (Ray exports SGLangHttpServer with cloudpickle):
    # the original under a name its __qualname__ resolves to, ours at this module's top level.
    cls = mod.SGLangHttpServer
    orig = cls.launch_server
    orig.__qualname__ = "SGLangHttpServer._verl_launch_server"
    cls._verl_launch_server = orig
    cls.launch_server = _launch_server_on_free_port
    mod.run_uvicorn = _run_uvicorn_on_server_args_port
    from sglang.srt.entrypoints.engine import Engine

    if not _ORIG_LAUNCH_SUBPROCESSES:
        _ORIG_LAUNCH_SUBPROCESSES.append(Engine._launch_subprocesses)
        Engine._launch_subprocesses = classmethod(_launch_subprocesses_verl_order)


AFTER_IMPORT = {
    "verl.workers.rollout.sglang_rollout.async_sglang_server": _patch_async_sglang_server,
    "verl.workers.rollout.sglang_rollout.http_server_engine": _patch_http_server_engine,
}


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name not in AFTER_IMPORT:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None:
            return None
        self._inner = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        AFTER_IMPORT[module.__name__](module)


_installed = False


def setup():
    global _installed
    if _installed:
        return
    _installed = True
    dataclasses.fields = _fields
    for name, patch in AFTER_IMPORT.items():
        if name in sys.modules:
            patch(sys.modules[name])
    sys.meta_path.insert(0, _AfterImport())
