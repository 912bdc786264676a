"""Run tox environments one after another, each one's install overlapping the tests of the one before.

    python scripts/run_envs.py ENV[,ENV...] [--judged-by-table ENV[,ENV...]] [-- POSARGS]

The engine environments take minutes to install (sglang's ~11 GB, vLLM's ~9 GB: mostly waiting on
the network and the disk) while their tests keep both cores busy. So while one environment's tests
run, the next one installs (`tox -e NEXT --notest`, its output in `.tox/prefetch-NEXT.log`): at most
two environments are on disk at once, each removed after its tests where P2PSYNC_PRUNE_ENVS=1
(scripts/prune_env.py). p2psync is built once, as a wheel that every environment installs, so that
no two tox processes package the project in the same folder at once. Every environment runs,
whatever the others did; the exit status is the first failing environment's, else 0, leaving out
those `--judged-by-table` names: the conformance table that runs next judges them (and prints what
each one ran), so their failure must not stop tox before it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOX = [sys.executable, "-m", "tox"]


def build_wheel(folder: str) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", folder, str(ROOT)], check=True
    )
    (wheel,) = Path(folder).glob("p2psync-*.whl")
    return wheel


def prefetch(env: str, package: list[str]) -> tuple[subprocess.Popen[bytes], Path]:
    """Install `env` in the background; its process and log."""
    log = ROOT / ".tox" / f"prefetch-{env}.log"
    log.parent.mkdir(exist_ok=True)
    with open(log, "wb") as out:
        process = subprocess.Popen([*TOX, "-e", env, "--notest", *package], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    print(f"run_envs: installing {env} beside the tests before it (log: {log})", flush=True)
    return process, log


def main(envs: list[str], posargs: list[str], judged_by_table: frozenset[str] = frozenset()) -> int:
    status = 0
    with tempfile.TemporaryDirectory() as folder:
        package = ["--installpkg", str(build_wheel(folder))]
        ahead: tuple[subprocess.Popen[bytes], Path] | None = None
        for index, env in enumerate(envs):
            if ahead is not None:
                process, log = ahead
                if process.wait() != 0:  # the run below installs it again and shows why it fails
                    print(f"run_envs: installing {env} ahead failed ({process.returncode}):\n"
                          f"{log.read_text(errors='replace')[-3000:]}", flush=True)
            ahead = prefetch(envs[index + 1], package) if index + 1 < len(envs) else None
            code = subprocess.run([*TOX, "-e", env, *package, "--", *posargs], cwd=ROOT).returncode
            print(f"run_envs: {env} exited {code}", flush=True)
            if env not in judged_by_table:
                status = status or code
    return status


if __name__ == "__main__":
    args = sys.argv[1:]
    split = args.index("--") if "--" in args else len(args)
    parser = argparse.ArgumentParser(description="Run tox environments, each installing while the one before runs.")
    parser.add_argument("envs", help="ENV[,ENV...], in the order they run")
    parser.add_argument("--judged-by-table", default="", metavar="ENV[,ENV...]",
                        help="environments whose exit status the conformance table judges instead")
    parsed = parser.parse_args(args[:split])
    judged = frozenset(filter(None, parsed.judged_by_table.split(",")))
    sys.exit(main(parsed.envs.split(","), args[split + 1:], judged))
