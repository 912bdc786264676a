"""Remove a finished tox environment when P2PSYNC_PRUNE_ENVS=1 (set by .ci/run).

The engine environments hold about 10 GB each (vLLM and sglang each bring their own
CUDA build of torch); a CI machine's disk need not hold them all at once, and CI never
reuses one. Developers keep theirs: without the variable this does nothing.

The environment is renamed aside at once and deleted by a process of its own while the next
environment's tests run: deleting one in place held CI up 12-55 s per environment.
"""

from __future__ import annotations

import os
import subprocess
import sys


def main(envdir: str) -> None:
    if os.environ.get("P2PSYNC_PRUNE_ENVS") != "1" or not os.path.isdir(envdir):
        return
    aside = f"{envdir}.pruned-{os.getpid()}"
    os.rename(envdir, aside)
    subprocess.Popen(["rm", "-rf", aside], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True)
    print(f"pruned {envdir} (deleting {aside} in the background)")


if __name__ == "__main__":
    main(sys.argv[1])
