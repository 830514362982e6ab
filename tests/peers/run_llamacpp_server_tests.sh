#!/usr/bin/env bash
# Runs llama.cpp's server test suite (examples/server/tests of a llama.cpp checkout, default
# /work/peers/llama.cpp; LLAMACPP_DIR to change it) against kvserve through llama_server_shim.py
# (which maps llama-server's options to `kvserve serve`). Nothing of the suite is copied into
# this repository: it is copied to a temporary folder and run there.
#   tests/peers/run_llamacpp_server_tests.sh [pytest args...]   (no file named: the OpenAI-compatible
#   files: unit/test_chat_completion.py unit/test_completion.py unit/test_basic.py
#   unit/test_security.py)
# Needs /usr/bin/python3 with pytest, requests and wget (Debian: python3-pytest python3-requests
# python3-wget); the openai package is optional (without it, tests that use its client are
# reported as skipped). Exit 77 (skipped) when the suite or pytest is absent; otherwise
# pytest's exit status. docs/api.md lists the cases that still fail and why.
set -u
here=$(cd "$(dirname "$0")" && pwd)
suite="${LLAMACPP_DIR:-/work/peers/llama.cpp}/examples/server/tests"
: "${KVSERVE_BIN:=$here/../../build/kvserve}"
: "${KVSERVE_TEST_DATA:=$here/../../../shared/data}"
export KVSERVE_BIN KVSERVE_TEST_DATA
py=/usr/bin/python3
if [ ! -f "$suite/utils.py" ]; then echo "SKIP: llama.cpp's server tests not found at $suite (set LLAMACPP_DIR)"; exit 77; fi
if ! $py -c "import pytest, requests, wget" 2>/dev/null; then
    echo "SKIP: needs $py with pytest, requests, wget (apt-get install python3-pytest python3-requests python3-wget)"; exit 77
fi
if [ ! -x "$KVSERVE_BIN" ]; then echo "FAIL: kvserve binary not found at $KVSERVE_BIN"; exit 1; fi
tmp=$(mktemp -d /tmp/kvserve-llamacpp-tests.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
cp -r "$suite"/. "$tmp"/
pp="$tmp"
if ! $py -c "import openai" 2>/dev/null; then
    echo "NOTE: the openai Python package is not installed: tests using its client are skipped"
    pp="$here/stub_openai:$tmp"
fi
files=0
for a in "$@"; do case "$a" in -*) ;; *) files=1 ;; esac; done
[ $files = 1 ] || set -- "$@" unit/test_chat_completion.py unit/test_completion.py unit/test_basic.py unit/test_security.py
cd "$tmp" && PYTHONPATH="$pp" LLAMA_SERVER_BIN_PATH="$here/llama_server_shim.py" LLAMA_CACHE="$tmp/cache" \
    $py -m pytest -p no:cacheprovider -q -rfEs "$@"
