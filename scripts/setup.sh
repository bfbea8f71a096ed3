#!/usr/bin/env bash
# One-step install on a fresh Debian machine: system tools (sshd, patch) and a .venv with servops.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
need=()
# prometheus-pushgateway: the tests push bench results to a real one on loopback.
# chromium: the tests open tune.report's HTML page in a real headless browser.
for pair in sshd:openssh-server ssh:openssh-client patch:patch ssh-keygen:openssh-client \
            prometheus-pushgateway:prometheus-pushgateway chromium:chromium; do
  cmd=${pair%%:*}; pkg=${pair#*:}
  if ! command -v "$cmd" >/dev/null 2>&1 && [ ! -x "/usr/sbin/$cmd" ]; then need+=("$pkg"); fi
done
# postgresql: the tests share a tune study between two controllers through a real server on loopback.
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || need+=(postgresql)
python3 -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv)
if [ ${#need[@]} -gt 0 ]; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q -e '.[dev]'
echo "servops installed: $(.venv/bin/invoke --version | head -1); run the tests with .venv/bin/python -m pytest"
