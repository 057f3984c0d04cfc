# Sourced by scripts/demo and scripts/test: make sure the machine has what vsup's set-up needs
# (Python >= 3.11 with venv, numactl).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

apt_install() {
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "vsup setup: installing $* (apt-get)"
        (apt-get install -y -q "$@" >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "$@" >/dev/null; })
    else
        echo "vsup setup: please install $* (e.g. sudo apt-get install $*)" >&2
        return 1
    fi
}

PYTHON="${PYTHON:-python3}"
"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), sys.version' \
    || { echo "vsup needs Python >= 3.11 (found $("$PYTHON" --version 2>&1)); set PYTHON=python3.11" >&2; exit 1; }
"$PYTHON" -c 'import ensurepip, venv' 2>/dev/null || apt_install python3-venv
command -v numactl >/dev/null || apt_install numactl || echo "vsup setup: numactl missing: vsup falls back to taskset (memory not bound)" >&2
