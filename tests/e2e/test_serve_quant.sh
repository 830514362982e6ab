#!/usr/bin/env bash
# e2e: kvserve serve on every quantized tiny-quant GGUF gives the tokens and logprobs of its
# dequant-f32 twin, and keeps the weights mapped in their stored precision (RSS); see
# tests/e2e/serve_quant.py.
set -u
here="$(cd "$(dirname "$0")" && pwd)"
: "${KVSERVE_BIN:=$here/../../build/kvserve}"
: "${KVSERVE_TEST_DATA:=$here/../../../shared/data}"
export KVSERVE_BIN KVSERVE_TEST_DATA
if [ ! -f "$KVSERVE_TEST_DATA/models/tiny-quant/tiny-f32.gguf" ]; then
    echo "SKIP: test data not found in $KVSERVE_TEST_DATA (set KVSERVE_TEST_DATA)"
    exit 77
fi
if [ ! -x "$KVSERVE_BIN" ]; then
    echo "FAIL: kvserve binary not found at $KVSERVE_BIN (set KVSERVE_BIN)"
    exit 1
fi
exec /usr/bin/python3 "$here/serve_quant.py" "$@"
