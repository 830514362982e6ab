#!/usr/bin/env bash
# e2e: kvserve router against fake workers (tests/e2e/fake_worker.py), the "streams" cases of
# tests/e2e/router_e2e.py. Needs only python3 (no model).
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
exec python3 "$here/router_e2e.py" streams "$@"
