#!/usr/bin/env bash
# e2e: etcd discovery (kvserve serve --etcd registers, kvserve router --etcd watches) against a
# throwaway etcd on loopback (Debian etcd-server). Skipped (exit 77) when etcd is missing or
# cannot start.
set -u
here="$(cd "$(dirname "$0")" && pwd)"
: "${KVSERVE_BIN:=$here/../../build/kvserve}"
export KVSERVE_BIN
if [ ! -x "$KVSERVE_BIN" ]; then
    echo "FAIL: kvserve binary not found at $KVSERVE_BIN (set KVSERVE_BIN)"
    exit 1
fi
if ! command -v python3 >/dev/null; then
    echo "SKIP: python3 not found"
    exit 77
fi
exec python3 "$here/routing.py" etcd
