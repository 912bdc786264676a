"""Remove a finished tox environment when P2PSYNC_PRUNE_ENVS=1 (set by .ci/run).

The engine environments hold about 10 GB each (vLLM and sglang each bring their own
CUDA build of torch); a CI machine's disk need not hold them all at once, and CI never
reuses one. Developers keep theirs: without the variable this does nothing.
"""

from __future__ import annotations

import os
import shutil
import sys


def main(envdir: str) -> None:
    if os.environ.get("P2PSYNC_PRUNE_ENVS") == "1":
        shutil.rmtree(envdir, ignore_errors=True)
        print(f"pruned {envdir}")


if __name__ == "__main__":
    main(sys.argv[1])
