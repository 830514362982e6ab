#!/usr/bin/env bash
# kvserve serve --kv-cache-dtype: unknown dtypes exit 2 for every backend, f16 exits 2 on
# the cuda backend (with a message naming the option); --help documents the option and its
# per-backend support. No model or GPU needed (the options are checked before anything is
# loaded). That the cpu backend serves f16 / bf16 KV is tested in test_backend and
# test_http_kv_dtype.
set -uo pipefail
bin=${KVSERVE_BIN:?}
fail() { echo "FAIL: $*"; exit 1; }
expect2() { # expect2 WORD... : serve with those options exits 2 and says --kv-cache-dtype
  local out rc
  out=$(timeout 20 "$bin" serve "$@" 2>&1 </dev/null); rc=$?
  [[ $rc == 2 ]] || fail "serve $* exited $rc (want 2): $out"
  [[ $out == *"--kv-cache-dtype"* ]] || fail "serve $*: message does not name --kv-cache-dtype: $out"
}
expect2 --kv-cache-dtype fp8
expect2 --backend cpu --kv-cache-dtype q8
expect2 --backend cuda --kv-cache-dtype f16
expect2 --backend cuda --kv-cache-dtype nope
help=$("$bin" serve --help) || fail "serve --help failed"
[[ $help == *"--kv-cache-dtype f32|f16|bf16"* && $help == *"default f32"* ]] || fail "--help: $help"
echo "ok"
