#!/usr/bin/env bash
# kvserve serve --kv-cache-dtype: the cpu backend accepts only f32 (anything else exits 2
# with a message naming the option); unknown dtypes exit 2 for every backend; --help
# documents the option and its per-backend defaults. No model or GPU needed (the options
# are checked before anything is loaded).
set -uo pipefail
bin=${KVSERVE_BIN:?}
fail() { echo "FAIL: $*"; exit 1; }
expect2() { # expect2 WORD... : serve with those options exits 2 and says --kv-cache-dtype
  local out rc
  out=$(timeout 20 "$bin" serve "$@" 2>&1 </dev/null); rc=$?
  [[ $rc == 2 ]] || fail "serve $* exited $rc (want 2): $out"
  [[ $out == *"--kv-cache-dtype"* ]] || fail "serve $*: message does not name --kv-cache-dtype: $out"
}
expect2 --kv-cache-dtype bf16
expect2 --backend cpu --kv-cache-dtype bf16
expect2 --kv-cache-dtype f16
expect2 --kv-cache-dtype fp8
expect2 --backend cuda --kv-cache-dtype f16
expect2 --backend cuda --kv-cache-dtype nope
help=$("$bin" serve --help) || fail "serve --help failed"
[[ $help == *"--kv-cache-dtype f32|bf16"* && $help == *"default f32"* ]] || fail "--help: $help"
echo "ok"
