#!/usr/bin/env bash
# e2e: disaggregated serving with real processes (context + generation workers, KV transfer
# over tcp and ucx, kvserve router): outputs equal the aggregated worker's, fault injection,
# stale sweep, conditional disaggregation, two network namespaces; see tests/e2e/disagg.py.
set -u
here="$(cd "$(dirname "$0")" && pwd)"
: "${KVSERVE_BIN:=$here/../../build/kvserve}"
: "${KVSERVE_TEST_DATA:=$here/../../../shared/data}"
export KVSERVE_BIN KVSERVE_TEST_DATA
if [ ! -f "$KVSERVE_TEST_DATA/models/stories260K/stories260K.gguf" ]; then
    echo "SKIP: test data not found in $KVSERVE_TEST_DATA (set KVSERVE_TEST_DATA)"
    exit 77
fi
if [ ! -x "$KVSERVE_BIN" ]; then
    echo "FAIL: kvserve binary not found at $KVSERVE_BIN (set KVSERVE_BIN)"
    exit 1
fi
exec /usr/bin/python3 "$here/disagg.py" "$@"
