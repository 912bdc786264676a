#!/usr/bin/env bash
# Set up this machine for p2psync: the system libraries Mooncake needs even over
# TCP (the verbs userland), iproute2 (ip and tc: the cluster in a box shapes loopback
# links in a network namespace of its own) and iptables (its links' latency: a netfilter
# queue), then .venv with p2psync (editable), its CPU extras and tox.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
for pkg in libibverbs1 librdmacm1 ibverbs-providers iproute2 iptables; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -c constraints/cpu.txt -e '.[mooncake,nixl,demo,test]' tox 2>&1 \
  | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import p2psync, mooncake.engine, nixl_cu12, transformers"
echo "setup done: .venv"
