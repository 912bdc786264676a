"""The trainer-side control client of the endpoints of one engine's ranks."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..core.control import post
from ..core.delta import PatchRecord
from ..core.engine import EngineControl
from ..core.errors import ControlError, EngineUnreachable, where
from ..core.pause import PauseMode
from ..core.types import Region, TargetTable

#: `TargetTable.extra` key under which an endpoint lists its pause modes, best first.
PAUSE_MODES_KEY = "pause_modes"


class EndpointControl(EngineControl):
    """Trainer-side client of the endpoints of one engine's ranks."""

    def __init__(self, tables: Sequence[TargetTable], *, timeout: float, token: str = "") -> None:
        self.tables = sorted(tables, key=lambda t: t.rank)
        self.timeout = timeout
        self.token = token

    def _call(self, table: TargetTable, route: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        try:
            return post(table.control_url, route, body, token=self.token, timeout=self.timeout)
        except ControlError as exc:
            raise type(exc)(f"{where(table.engine_id, table.rank)}: {exc}") from exc

    def check_access(self) -> None:
        for table in self.tables:
            answer = self._call(table, "info")
            if answer.get("instance") != table.instance:  # the publisher is gone: another process holds its port
                raise EngineUnreachable(
                    f"{where(table.engine_id, table.rank)}: {table.control_url} answers as {answer.get('instance')!r}, "
                    f"not as {table.instance!r}, which published the table"
                )

    def pause_modes(self) -> tuple[PauseMode, ...]:
        """The modes every rank's endpoint has, in rank 0's order."""
        offered = [tuple(t.extra.get(PAUSE_MODES_KEY, ("abort",))) for t in self.tables]
        return tuple(mode for mode in offered[0] if all(mode in modes for modes in offered[1:]))

    def pause(self, version: str, lease: float, mode: PauseMode, *, flush_cache: bool = True) -> list[TargetTable]:
        moved = []
        # a drain ("wait") ends before this call times out, so that a refusal reaches the trainer
        body = {"version": version, "lease": lease, "mode": mode, "flush_cache": flush_cache,
                "drain_seconds": min(lease, 0.9 * self.timeout)}
        for i, table in enumerate(self.tables):
            answer = self._call(table, "pause", body)
            info = answer.get("transport_info")
            if info is not None and info != table.transport_info:
                self.tables[i] = dataclasses.replace(table, transport_info=info)
                moved.append(self.tables[i])
        return moved

    def renew(self, version: str) -> None:
        for table in self.tables:
            self._call(table, "renew", {"version": version})

    def finish(self, version: str) -> None:
        for table in self.tables:
            self._call(table, "finish", {"version": version})

    def fail(self, version: str, reason: str) -> None:
        """Every rank is told, even after one could not be (the others may serve `version`)."""
        errors = []
        for table in self.tables:
            try:
                self._call(table, "fail", {"version": version, "reason": reason})
            except ControlError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def label_refusal(self, version: str, *, rollback: bool) -> str | None:
        body = {"version": version, "rollback": rollback}
        refusals = [self._call(table, "label", body)["refused"] for table in self.tables]
        return next((refusal for refusal in refusals if refusal), None)

    def digests(self, rank: int, regions: Mapping[str, Sequence[Region]]) -> dict[str, str]:
        spans = {name: [[r.param_offset, r.nbytes] for r in rs] for name, rs in regions.items()}
        return self._call(self.tables[rank], "digest", {"regions": spans})["digests"]

    def apply_patch(self, rank: int, version: str, records: Sequence[PatchRecord]) -> None:
        self._call(self.tables[rank], "patch", {"version": version, "records": [r.to_wire() for r in records]})

    def held(self) -> dict[int, tuple[str | None, str | None]]:
        with ThreadPoolExecutor(max_workers=max(1, len(self.tables)), thread_name_prefix="p2psync-held") as pool:
            answers = list(pool.map(lambda table: self._call(table, "held"), self.tables))
        return {table.rank: (answer["version"], answer["altered"]) for table, answer in zip(self.tables, answers)}

    def info(self, rank: int) -> dict[str, Any]:
        return self._call(self.tables[rank], "info")
