"""sglang's modules an engine rank imports, for a fork server to import once before it forks
ranks (`p2psync.worlds.processes`): 12 s of imports per rank on a 2-core machine."""

from __future__ import annotations

import sglang.srt.configs.model_config  # noqa: F401
import sglang.srt.model_loader.loader  # noqa: F401
import sglang.srt.server_args  # noqa: F401
