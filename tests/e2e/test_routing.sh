#!/usr/bin/env bash
# e2e: kvserve router placement policies over four real stories260K workers (issue 9
# acceptance: stickiness, content placement, burst, health, refusals, coordinator; policies).
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
if [ $# -eq 0 ]; then set -- policies sticky content burst coordinator refuse health; fi
exec python3 "$here/routing.py" "$@"
