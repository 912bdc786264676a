"""The trainer-side control client of the endpoints of one engine's ranks."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..core.control import post
from ..core.delta import PatchRecord
from ..core.engine import EngineControl
from ..core.errors import ControlError, where
from ..core.types import Region, TargetTable


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
            raise ControlError(f"{where(table.engine_id, table.rank)}: {exc}") from exc

    def check_access(self) -> None:
        for table in self.tables:
            answer = self._call(table, "info")
            if answer.get("instance") != table.instance:
                raise ControlError(
                    f"{where(table.engine_id, table.rank)}: {table.control_url} answers as {answer.get('instance')!r}, "
                    f"not as {table.instance!r}, which published the table"
                )

    def pause(self, version: str, lease: float) -> list[TargetTable]:
        moved = []
        for i, table in enumerate(self.tables):
            answer = self._call(table, "pause", {"version": version, "lease": lease})
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
        for table in self.tables:
            self._call(table, "fail", {"version": version, "reason": reason})

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
