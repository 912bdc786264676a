"""Engine ids from the framework's identity of each replica (issue #44): one template, one
job environment, N replicas, N ids."""

from __future__ import annotations

import pytest

from p2psync.core import identity
from p2psync.core.identity import REPLICA_ENV, expand_engine_id


def test_a_plain_id_is_itself():
    assert expand_engine_id("rollout") == "rollout"


@pytest.mark.parametrize(
    ("actor", "replica"),
    [("sglang_server_3_0", "3"), ("rollout_12", "12"), ("engine-7", "7")],  # verl's server actors, and others'
)
def test_the_replica_is_the_first_number_of_the_ray_actors_name(monkeypatch, actor, replica):
    monkeypatch.delenv(REPLICA_ENV, raising=False)
    monkeypatch.setattr(identity, "_ray_actor_name", lambda: actor)
    assert expand_engine_id("rollout-{replica}") == f"rollout-{replica}"
    assert expand_engine_id("{actor}") == actor


def test_the_environment_names_the_replica_over_the_actor(monkeypatch):
    monkeypatch.setattr(identity, "_ray_actor_name", lambda: "sglang_server_3_0")
    monkeypatch.setenv(REPLICA_ENV, "9")
    assert expand_engine_id("rollout-{replica}") == "rollout-9"


def test_a_field_nothing_gives_is_an_error_naming_the_template_and_what_is_known(monkeypatch):
    monkeypatch.delenv(REPLICA_ENV, raising=False)
    monkeypatch.setattr(identity, "_ray_actor_name", lambda: None)
    with pytest.raises(ValueError, match=r"'rollout-\{replica\}' names replica, which nothing here gives"):
        expand_engine_id("rollout-{replica}")


def test_partly_filled_in_where_a_later_process_knows_the_rest(monkeypatch):
    monkeypatch.setenv(REPLICA_ENV, "2")
    monkeypatch.setattr(identity, "_ray_actor_name", lambda: None)
    assert expand_engine_id("r{replica}-dp{dp_rank}", partial=True) == "r2-dp{dp_rank}"
    assert expand_engine_id("r2-dp{dp_rank}", {"dp_rank": 1}) == "r2-dp1"
