#!/usr/bin/env bash
# bench_qdot's arguments: bad ones exit 2 with a message and print no table; a short valid run
# of the integer path prints one line per M, with the repack's column for M > 4 and a ratio.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/lib.sh"
build="${KVSERVE_BUILD:?KVSERVE_BUILD not set}"
bin="$build/bench_qdot"
[[ -x $bin ]] || skip_test "$bin not built"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

expect2() {
  expect_usage_error "$bin" "$@"
  [[ $usage_out != *"ns/w"* ]] || fail "a table was printed before refusing: bench_qdot $*"
}
expect2 --m 0
expect2 --m 513
expect2 --m 1,
expect2 --m ,1
expect2 --m 1,,2
expect2 --m abc
expect2 --m 1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17
expect2 --rows 7 --m 4          # the float panel path writes 4 rows at a time
expect2 --k 300
expect2 --k 1048576 --rows 128  # 128 rows x 4 x K over the 320 MiB buffer
expect2 --bogus

"$bin" --int8 --k 256 --rows 8 --m 2,8 --types Q4_K,Q6_K --runs 1 --ms 1 --hot >"$tmp/ok" 2>&1 ||
  fail "a valid run failed: $(cat "$tmp/ok")"
for t in Q4_K Q6_K; do
  grep -Eq " $t +2 hot .*int8 [0-9.]+ ns/w" "$tmp/ok" || fail "no M = 2 line for $t: $(cat "$tmp/ok")"
  grep -Eq " $t +8 hot .*int8 [0-9.]+ ns/w .*pack [0-9.]+ ns/w \([0-9.]+x\)" "$tmp/ok" ||
    fail "no M = 8 line with the pack column for $t: $(cat "$tmp/ok")"
done
echo "bench_qdot arguments: ok"
