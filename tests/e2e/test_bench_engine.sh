#!/usr/bin/env bash
# bench_engine's --prefetch-ab (the decode pass alternated between the software-prefetch modes
# of src/quant/quant.h inside one process) and KVSERVE_CPU_PREFETCH: bad values exit 2 with a
# message and print no table; a short run on stories260K prints one line per pair with both
# rates and their ratio, then the median; the header names the mode KVSERVE_CPU_PREFETCH forces;
# kvserve serve / generate refuse a bad KVSERVE_CPU_PREFETCH at start.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/lib.sh"
build="${KVSERVE_BUILD:?KVSERVE_BUILD not set}"
bin="$build/bench_engine"
data="${KVSERVE_TEST_DATA:-$here/../../../shared/data}"
model="$data/models/stories260K/stories260K.gguf"
[[ -x $bin ]] || skip_test "$bin not built"
[[ -f "$model" ]] || skip_test "$model not found (set KVSERVE_TEST_DATA)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

expect2() {
  expect_usage_error "$bin" "$@"
  [[ $usage_out != *"tok/s"* ]] || fail "a table was printed before refusing: bench_engine $*"
}
expect2 --model "$model" --prefetch-ab 0
expect2 --model "$model" --prefetch-ab -1
expect2 --model "$model" --prefetch-ab abc
expect2 --model "$model" --prefetch-ab 1001
expect2 --model "$model" --prefetch-ab 1x
expect2 --model "$model" --prefetch-ab 2.5
expect2 --model "$model" --prefetch-ab 2 --grammar json
[[ $usage_err == *"--prefetch-ab"* ]] || fail "the refusal does not name --prefetch-ab: $usage_err"
KVSERVE_CPU_PREFETCH=t1 expect_usage_error "$bin" --model "$model" --concurrency 1 --gen-len 4
[[ $usage_err == *"KVSERVE_CPU_PREFETCH"* ]] || fail "KVSERVE_CPU_PREFETCH=t1 refused without naming it: $usage_err"

# the server and generate refuse it too, before loading the model
kv="${KVSERVE_BIN:-$build/kvserve}"
if [[ -x $kv ]]; then
  KVSERVE_CPU_PREFETCH=t0 expect_usage_error "$kv" serve --model "$model" --port 1
  [[ $usage_err == *"KVSERVE_CPU_PREFETCH"* ]] || fail "kvserve serve: KVSERVE_CPU_PREFETCH=t0 refused without naming it: $usage_err"
  KVSERVE_CPU_PREFETCH=" nta" expect_usage_error "$kv" generate --model "$model" --prompt hi
  [[ $usage_err == *"KVSERVE_CPU_PREFETCH"* ]] || fail "kvserve generate: KVSERVE_CPU_PREFETCH refused without naming it: $usage_err"
fi

"$bin" --model "$model" --threads 1 --prompt-len 8 --gen-len 8 --concurrency 1,2 --prefetch-ab 3 >"$tmp/ab" 2>&1 ||
  fail "a valid --prefetch-ab run failed: $(cat "$tmp/ab")"
for c in 1 2; do
  n=$(grep -Ec "^$c +[1-3] +[0-9.]+ +[0-9.]+ +[0-9.]+$" "$tmp/ab" || true)
  [[ $n == 3 ]] || fail "expected 3 pair lines for concurrency $c, got $n: $(cat "$tmp/ab")"
  grep -Eq "^$c +median nta/cache [0-9.]+ \(min [0-9.]+, max [0-9.]+\)$" "$tmp/ab" ||
    fail "no median line for concurrency $c: $(cat "$tmp/ab")"
done
# every rate is positive and each ratio is nta / cache of its own line
awk '$2 ~ /^[0-9]+$/ && NF == 5 { if ($3 <= 0 || $4 <= 0) bad = 1; r = $4 / $3; if (r / $5 > 1.01 || r / $5 < 0.99) bad = 1 }
     END { exit bad }' "$tmp/ab" || fail "a pair line's ratio is not nta / cache: $(cat "$tmp/ab")"

for mode in cache nta; do
  KVSERVE_CPU_PREFETCH=$mode "$bin" --model "$model" --threads 1 --prompt-len 8 --gen-len 4 --concurrency 1 \
    >"$tmp/$mode" 2>&1 || fail "KVSERVE_CPU_PREFETCH=$mode run failed: $(cat "$tmp/$mode")"
  grep -q "prefetch $mode (KVSERVE_CPU_PREFETCH)" "$tmp/$mode" || fail "header does not name prefetch $mode: $(cat "$tmp/$mode")"
done
echo "bench_engine --prefetch-ab and KVSERVE_CPU_PREFETCH: ok"
