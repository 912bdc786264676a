"""Errors that name what was wrong: the engine, the rank, the parameter."""

from __future__ import annotations


class P2PSyncError(Exception):
    """Base of every error p2psync raises on purpose."""


class PluginError(P2PSyncError):
    """A plugin registered a class without a name, or under a name already taken."""


class OptionsError(P2PSyncError, ValueError):
    """An option that the class it is given to does not take, or a value of the wrong type."""


class ConnectError(P2PSyncError):
    """`connect` found something a layout, the plan or a transport cannot serve.

    Raised before anything is written, so no engine sees partial weights.
    """


class RendezvousError(P2PSyncError):
    """The rendezvous held no table, a late table, or data that does not parse."""


class TransferError(P2PSyncError):
    """A write to one engine failed; the other engines are not affected."""


class TransferTimeout(TransferError):
    """A write to one engine did not complete within `transfer_timeout`."""


class ControlError(P2PSyncError):
    """An engine control call (pause, resume, digest, ...) failed."""


class EngineUnreachable(ControlError):
    """An engine control call got no answer (refused, reset, timed out): the engine is gone,
    stopped or cut off, unlike one that answered with a refusal. A call that got no answer
    may still land later."""


class UpdateError(P2PSyncError):
    """`update` failed on the trainer side (a gather, a collective, the caller's own code).

    The engines it paused are not resumed: each marks itself stale once its update
    lease runs out. The session cannot be used again.
    """


class TrainerLost(UpdateError):
    """A trainer rank left the world during `update`; the message names it."""


class TrainerRankFailed(UpdateError):
    """`update` raised on one or more trainer ranks whose processes live on (the caller's
    `progress`, a source's own code): every rank raises this, at the same point, naming each
    failing rank and its exception (`failures`: rank -> "Type: message")."""

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures


class ConcurrentCallError(P2PSyncError):
    """`connect` or `update` was called on a Session while another thread's call was running
    on it; the running call is not disturbed."""


class VersionError(P2PSyncError):
    """An update's version label was used before in this session, or orders before the
    latest one: one label would name two sets of weights. Raised before anything is written."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (torch's distributed errors append C++
    frames), or its type's name if it has none."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def where(engine_id: str, rank: int | None = None, param: str | None = None) -> str:
    """Format the place an error is about, the same way everywhere."""
    text = f"engine {engine_id!r}"
    if rank is not None:
        text += f" rank {rank}"
    if param is not None:
        text += f" parameter {param!r}"
    return text
