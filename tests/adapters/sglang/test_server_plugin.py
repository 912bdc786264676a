"""The sglang plugin's `server_url` setting: where the trainer pauses the server, or nowhere
where the framework pauses it (verl). The oracle: the table extra each scheduler's endpoint is
served with, and the control the trainer builds from such a table."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang", reason="sglang is not installed (tox -e conformance-sglang)")

from p2psync.adapters.sglang import endpoint, server_plugin  # noqa: E402
from p2psync.adapters.sglang.server import ServedControl  # noqa: E402
from p2psync.adapters.sglang.target import SglangEngineTarget  # noqa: E402
from p2psync.core.types import TargetTable  # noqa: E402
from p2psync.engine.client import EndpointControl  # noqa: E402

ARGS = SimpleNamespace(host="127.0.3.3", port=30000, weight_version="v0")


def served_extra(monkeypatch, settings: dict) -> object:
    """The `extra` a scheduler of a server started with `settings` serves its endpoint with."""
    seen: list = []
    monkeypatch.setenv(server_plugin.ENDPOINT_ENV, json.dumps({"rendezvous": "h:1", "job_id": "j", "engine_id": "e",
                                                                "version": "v0", **settings}))
    monkeypatch.setattr(server_plugin, "_rendezvous", lambda settings: None)
    monkeypatch.setattr(endpoint, "serve", lambda *args, **kwargs: seen.append(kwargs["extra"]))
    monkeypatch.setattr(server_plugin, "_served", [])
    server_plugin._serve_rank(None, ARGS, None, 0, None)
    return seen[0]


def control_for(extra: object) -> object:
    table = TargetTable(engine_id="e", rank=0, world_size=1, engine="sglang", layout_key={}, transport="mooncake",
                        transport_info={}, control_url="http://127.0.0.1:1", params=(), extra=dict(extra or {}))
    return SglangEngineTarget().control([table], timeout=1.0)


def test_by_default_the_trainer_pauses_the_server_its_arguments_name(monkeypatch):
    extra = served_extra(monkeypatch, {})
    assert extra == {"server_url": "http://127.0.3.3:30000"}
    assert isinstance(control_for(extra), ServedControl)


def test_a_server_url_set_is_the_one_published(monkeypatch):
    assert served_extra(monkeypatch, {"server_url": "http://127.0.9.9:4242"}) == {"server_url": "http://127.0.9.9:4242"}


def test_a_null_server_url_publishes_none_and_the_trainer_pauses_the_endpoints_only(monkeypatch):
    extra = served_extra(monkeypatch, {"server_url": None})
    assert extra is None
    control = control_for(extra)
    assert type(control) is EndpointControl, type(control)
