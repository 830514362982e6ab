#!/usr/bin/env bash
# Runs one Python e2e script of this folder against the built binary:
#   run_python_e2e.sh SCRIPT.py [ARGS...]
# FAIL (exit 1) without the kvserve binary (KVSERVE_BIN, default build/kvserve); SKIP (exit 77)
# without python3. Sourced by nothing; the test_*.sh wrappers exec it.
set -u
here="$(cd "$(dirname "$0")" && pwd)"
: "${KVSERVE_BIN:=$here/../../build/kvserve}"
export KVSERVE_BIN
if [ ! -x "$KVSERVE_BIN" ]; then
    echo "FAIL: kvserve binary not found at $KVSERVE_BIN (set KVSERVE_BIN)"
    exit 1
fi
source "$here/lib.sh"
need_cmd python3
script=$1
shift
exec python3 "$here/$script" "$@"
