"""The job's rendezvous under Ray: one named detached actor per job id.

Trainer rank 0 is a poor home for a job's rendezvous once its users' frameworks place
trainers and engines as Ray actors: engines start first and outlive trainer restarts. So the
rendezvous is an actor of its own, `p2psync-rendezvous-<job id>` in namespace "p2psync",
made by whichever process of the job asks first (`get_if_exists`) and found by name by the
rest. It runs on the head node, which lives as long as the cluster (not beside an engine or a
trainer whose node may go), hosts the store on that node's address, and hands out the job's
token with it: the token travels over Ray's own authenticated channel, never through the store. Each process
that asks sets `$P2PSYNC_TOKEN` (where unset) so that the processes it starts itself (an
sglang server's schedulers) hold it too.
"""

from __future__ import annotations

import logging
import os
import secrets
from functools import cache
from typing import Any

from ...core.rendezvous import Rendezvous
from ...core.token import TOKEN_ENV

log = logging.getLogger(__name__)

#: The rendezvous address that means "the job's rendezvous actor".
RAY = "ray"
NAMESPACE = "p2psync"
ACTOR_NAME = "p2psync-rendezvous-{}"
#: The resource Ray gives its head node alone.
HEAD_NODE = "node:__internal_head__"


def rendezvous_at(
    address: str, *, job_id: str, timeout: float = 60.0, patient: bool = False, host_it: bool = False
) -> Rendezvous:
    """The job's rendezvous at `address`: "host:port" (hosted in this process where `host_it`
    says, as trainer rank 0 does on one machine; else a client), or "ray" (`job_rendezvous`:
    the actor hosts it, whatever `host_it` says)."""
    if address == RAY:
        return job_rendezvous(job_id, timeout=timeout, patient=patient)
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"a rendezvous address is 'host:port' or {RAY!r}, got {address!r}")
    return Rendezvous(
        host=host or "127.0.0.1", port=int(port), job_id=job_id, timeout=timeout, patient=patient, is_server=host_it
    )


def job_rendezvous(job_id: str, *, timeout: float = 60.0, patient: bool = False) -> Rendezvous:
    """A client of job `job_id`'s rendezvous actor (made where none runs), with the job's token.
    Call it where Ray is initialized (a Ray actor or driver)."""
    import ray

    if not ray.is_initialized():
        raise RuntimeError(f"p2psync's rendezvous {RAY!r} is found through Ray: call it inside a Ray actor or driver")
    actor = _actor_class().options(
        name=ACTOR_NAME.format(job_id), namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0,
        resources={HEAD_NODE: 0.001},
    ).remote(job_id, os.environ.get(TOKEN_ENV))
    host, port, token = ray.get(actor.address.remote(), timeout=timeout)
    named = os.environ.get(TOKEN_ENV)
    if named and named != token:
        raise RuntimeError(
            f"${TOKEN_ENV} in this process differs from the token job {job_id!r}'s rendezvous actor holds: set it "
            "alike in every process of the job, or in none"
        )
    os.environ[TOKEN_ENV] = token
    return Rendezvous(host=host, port=port, job_id=job_id, timeout=timeout, patient=patient, token=token)


@cache
def _actor_class() -> Any:
    import ray

    @ray.remote
    class JobRendezvous:
        """Hosts one job's store on its Ray node's address (whatever the process that made it
        set as its own: an actor started from another inherits its environment)."""

        def __init__(self, job_id: str, token: str | None) -> None:
            import ray.util

            self.token = token or secrets.token_hex(16)
            host = ray.util.get_node_ip_address()
            self.rendezvous = Rendezvous(host=host, port=0, job_id=job_id, is_server=True, token=self.token)
            log.info("job %r's rendezvous serves at %s", job_id, self.rendezvous.where)

        def address(self) -> tuple[str, int, str]:
            return self.rendezvous.host, self.rendezvous.port, self.token

    return JobRendezvous
