"""An engine rank's Prometheus metrics at GET /metrics (issue #47). The oracle: what the test
did to the engine (its declared version, two updates, an abandoned one), and Prometheus' text
format as its exposition rules state it (parsed here by hand: `name{labels} value`)."""

from __future__ import annotations

import re
import time
import urllib.request

from p2psync.adapters.torch import serve
from p2psync.core.rendezvous import Rendezvous
from p2psync.engine.client import EndpointControl
from tests.helpers.engines import RecordingTransport, small_model, wait_for

SAMPLE = re.compile(r'^(\w+)\{(.*)\} (\S+)$')


def scrape(url: str) -> tuple[str, dict[tuple[str, frozenset], float]]:
    """The page's content type, and each sample's value by (name, labels)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as answer:  # no token: a scraper has none
        kind, text = answer.headers["Content-Type"], answer.read().decode()
    samples = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.match(r"^# (HELP \w+ .+|TYPE \w+ (gauge|counter))$", line), line
            continue
        name, labels, value = SAMPLE.match(line).groups()
        samples[name, frozenset(re.findall(r'(\w+)="([^"]*)"', labels))] = float(value)
    return kind, samples


def test_metrics_follow_the_engines_updates_and_its_stale_mark():
    rendezvous = Rendezvous(host="127.0.0.1", port=0, job_id="metrics", is_server=True, timeout=5)
    endpoint = serve(small_model(1), engine_id="e", rendezvous=rendezvous, transport=RecordingTransport(), version="v0")
    who = frozenset({("job", "metrics"), ("engine", "e"), ("rank", "0")})
    try:
        kind, first = scrape(endpoint.url)
        assert kind.startswith("text/plain; version=0.0.4")
        assert first["p2psync_engine_serving", who] == 1 and first["p2psync_engine_updates_total", who] == 0
        assert first["p2psync_engine_version_info", who | {("version", "v0")}] == 1
        control = EndpointControl(rendezvous.read_engine("e"), timeout=5, token=rendezvous.token())
        for version in ("v1", "v2"):
            began = time.monotonic()
            control.pause(version, lease=30, mode="wait")
            time.sleep(0.05)
            control.finish(version)
            took = time.monotonic() - began
        _, after = scrape(endpoint.url)
        assert after["p2psync_engine_updates_total", who] == 2
        assert after["p2psync_engine_version_info", who | {("version", "v2")}] == 1
        assert 0.05 <= after["p2psync_engine_last_update_seconds", who] <= took
        assert time.time() - 5 <= after["p2psync_engine_last_update_timestamp_seconds", who] <= time.time()
        assert after["p2psync_engine_stale", who] == 0 and after["p2psync_engine_stale_total", who] == 0

        control.pause("v3", lease=0.3, mode="wait")  # never finished: abandoned when its lease ends
        _, stale = wait_for(lambda: (s := scrape(endpoint.url))[1]["p2psync_engine_stale", who] == 1 and s, 10,
                            "the stale mark in the metrics")
        assert stale["p2psync_engine_serving", who] == 0 and stale["p2psync_engine_stale_total", who] == 1
        assert stale["p2psync_engine_updates_total", who] == 2
    finally:
        endpoint.close()
