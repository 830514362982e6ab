#!/usr/bin/env bash
# kvserve bench end to end: trace reproducibility (same seed -> same bytes), then a
# 20-session multi-turn run against a real kvserve worker on stories260K: every request
# sent is reported, TTFT <= E2E for each, token counts equal `usage`; Ctrl-C still reports;
# --compare and --plot work.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin="${KVSERVE_BIN:?KVSERVE_BIN not set}"
data="${KVSERVE_TEST_DATA:-$here/../../../shared/data}"
model="$data/models/stories260K/stories260K.gguf"
tmp=$(mktemp -d)
srv_pid=""
cleanup() { [[ -n "$srv_pid" ]] && kill "$srv_pid" 2>/dev/null; wait 2>/dev/null; rm -rf "$tmp"; }
trap cleanup EXIT
source "$here/lib.sh"
need_cmd jq

# 1. same seed -> same trace, byte for byte; another seed -> another trace
syn=(--sessions 20 --turns 3 --system-tokens 8 --shared-fraction 0.5 --user-tokens 6 --tool-tokens 6
     --output-tokens 16 --think-time-ms 20)
"$bin" bench "${syn[@]}" --seed 7 --dry-run --save-trace "$tmp/a.jsonl" >/dev/null
"$bin" bench "${syn[@]}" --seed 7 --dry-run --save-trace "$tmp/b.jsonl" >/dev/null
"$bin" bench "${syn[@]}" --seed 8 --dry-run --save-trace "$tmp/c.jsonl" >/dev/null
cmp "$tmp/a.jsonl" "$tmp/b.jsonl" || fail "same seed gave different traces"
cmp -s "$tmp/a.jsonl" "$tmp/c.jsonl" && fail "different seeds gave the same trace"
[[ $(wc -l < "$tmp/a.jsonl") == 20 ]] || fail "trace should have 20 sessions"
# a saved trace replays to the same bytes
"$bin" bench --trace "$tmp/a.jsonl" --dry-run --save-trace "$tmp/d.jsonl" >/dev/null
cmp "$tmp/a.jsonl" "$tmp/d.jsonl" || fail "load+save changed the trace"
echo "ok: trace reproducible"

[[ -f "$model" ]] || skip_test "$model not found (set KVSERVE_TEST_DATA)"

# 2. a real worker
"$bin" serve --model "$model" --port 0 --port-file "$tmp/port" --max-model-len 512 > "$tmp/serve.log" 2>&1 &
srv_pid=$!
for _ in $(seq 100); do [[ -s "$tmp/port" ]] && break; sleep 0.1; done
[[ -s "$tmp/port" ]] || { cat "$tmp/serve.log"; fail "server did not start"; }
url="http://127.0.0.1:$(cat "$tmp/port")"

"$bin" bench --url "$url" --trace "$tmp/a.jsonl" --concurrency 4 --ignore-eos --temperature 0 \
  --out "$tmp/run.json" --plot "$tmp/plots" --quiet | tee "$tmp/table.txt"
j="$tmp/run.json"
[[ $(jq '.requests | length' "$j") == 60 ]] || fail "expected 60 request records"
[[ $(jq '.summary.requests' "$j") == 60 ]] || fail "summary.requests != 60"
[[ $(jq '.summary.failed' "$j") == 0 ]] || fail "failed requests: $(jq -c '[.requests[]|select(.error)|.error_message][0]' "$j")"
[[ $(jq '.summary.sessions_completed' "$j") == 20 ]] || fail "not all sessions completed"
grep -q "60 sent, 60 ok, 0 failed" "$tmp/table.txt" || fail "table does not report 60 requests"
# every (session, turn) exactly once
[[ $(jq '[.requests[] | "\(.session)/\(.turn)"] | unique | length' "$j") == 60 ]] || fail "duplicate records"
# TTFT <= E2E for every request
[[ $(jq '[.requests[] | select(.ttft_ms == null or .ttft_ms > .e2e_ms)] | length' "$j") == 0 ]] || fail "TTFT > E2E"
# token counts equal usage: output tokens == usage.completion_tokens == max_tokens (ignore_eos);
# streamed non-empty chunks never exceed it
[[ $(jq '[.requests[] | select(.completion_tokens == null or .output_tokens != .completion_tokens
        or .completion_tokens != .max_tokens or .chunks > .completion_tokens or .prompt_tokens == null)] | length' "$j") == 0 ]] \
  || fail "token counts differ from usage: $(jq -c '[.requests[]|{completion_tokens,output_tokens,max_tokens,chunks}][0]' "$j")"
[[ $(jq '[.requests[].completion_tokens] | add' "$j") == $(jq '.summary.output_tokens' "$j") ]] || fail "summary output tokens"
[[ $(jq '[.requests[].prompt_tokens] | add' "$j") == $(jq '.summary.prompt_tokens' "$j") ]] || fail "summary prompt tokens"
# later turns carry the history: prompts grow within a session
[[ $(jq '[.requests[] | select(.turn == 2)] | length' "$j") == 20 ]] || fail "turn 2 missing"
[[ $(jq '[.requests | group_by(.session)[] | sort_by(.turn) | select(.[2].prompt_tokens <= .[1].prompt_tokens or .[1].prompt_tokens <= .[0].prompt_tokens)] | length' "$j") == 0 ]] \
  || fail "multi-turn prompts do not grow"
[[ $(jq '.summary.workers | length' "$j") -ge 1 ]] || fail "no X-Kvserve-Worker share"
# KV reuse: later turns resend the history, so the worker serves part of every multi-turn
# prompt from its prefix cache: a non-zero cached-token ratio overall, cached_tokens > 0 on
# turn 2 of some session, and never more cached than prompt tokens
jq -e '.summary.cached_ratio | type == "number" and . > 0' "$j" >/dev/null \
  || fail "cached-token ratio on the multi-turn run is $(jq '.summary.cached_ratio' "$j") (want > 0)"
[[ $(jq '[.requests[] | select(.turn >= 1 and (.cached_tokens // 0) > 0)] | length' "$j") -gt 0 ]] \
  || fail "no later turn reports cached_tokens > 0: $(jq -c '[.requests[]|select(.turn==1)|{prompt_tokens,cached_tokens}][0:3]' "$j")"
[[ $(jq '[.requests[] | select((.cached_tokens // 0) > .prompt_tokens)] | length' "$j") == 0 ]] \
  || fail "cached_tokens > prompt_tokens"
echo "ok: 60 requests reported, TTFT <= E2E, tokens == usage; cached ratio $(jq '.summary.cached_ratio' "$j")"

# --compare a run with itself: ratios 1
"$bin" bench --compare "$j" "$j" > "$tmp/cmp.txt"
grep -q "^TTFT p50 ms .* 1.000$" "$tmp/cmp.txt" || { cat "$tmp/cmp.txt"; fail "--compare"; }
# three files: one column each, ratios against the first; --plot draws the comparison
"$bin" bench --compare "$j" "$j" "$j" > "$tmp/cmp3.txt"
grep -q "^req/s .* 1.000 *1.000$" "$tmp/cmp3.txt" || { cat "$tmp/cmp3.txt"; fail "--compare of 3 files"; }
"$bin" bench --compare "$j" 2>/dev/null && fail "--compare of one file accepted"
# --pool-workers: every file but the first takes its busiest worker's share over N workers
# (one server saw every request: 1 over itself, 4 over a pool of 4)
"$bin" bench --compare "$j" "$j" --pool-workers 4 > "$tmp/cmpp.txt"
grep -q "^max share/mean *1.000 *4.000$" "$tmp/cmpp.txt" || { cat "$tmp/cmpp.txt"; fail "--compare --pool-workers"; }
"$bin" bench --compare "$j" "$j" --pool-workers 0 2>/dev/null && fail "--pool-workers 0 accepted"
if command -v gnuplot >/dev/null; then
  "$bin" bench --compare "$j" "$j" "$j" --plot "$tmp/cmpplot" > /dev/null || fail "--compare --plot"
  [[ -s "$tmp/cmpplot/compare.png" && -s "$tmp/cmpplot/compare.svg" ]] || fail "--compare --plot did not draw"
  for f in ttft_cdf throughput latency workers; do
    [[ -s "$tmp/plots/$f.svg" && -s "$tmp/plots/$f.png" ]] || fail "--plot did not write $f"
  done
fi

# 3. Ctrl-C: stops cleanly, still reports, every request sent is counted
# (a run far longer than the test; interrupted once the server has answered some of it)
before=$(curl -s "$url/metrics" | awk '/^kvserve_requests_total/ {print $2}')
"$bin" bench --url "$url" --sessions 100000 --turns 2 --system-tokens 8 --tool-tokens 6 --output-tokens 64 \
  --concurrency 4 --out "$tmp/int.json" --quiet > "$tmp/int.txt" 2>&1 &
bpid=$!
for _ in $(seq 600); do
  now=$(curl -s "$url/metrics" | awk '/^kvserve_requests_total/ {print $2}')
  (( ${now%.*} >= ${before%.*} + 8 )) && break
  sleep 0.05 # a bounded poll for progress, not a timing assumption
done
kill -INT "$bpid"
rc=0; wait "$bpid" || rc=$?
[[ $rc == 130 ]] || { cat "$tmp/int.txt"; fail "interrupted bench exit code $rc (want 130)"; }
grep -q "interrupted" "$tmp/int.txt" || fail "no interrupted report"
[[ $(jq '.summary.interrupted' "$tmp/int.json") == true ]] || fail "summary.interrupted"
n=$(jq '.requests | length' "$tmp/int.json")
[[ $n -gt 0 && $n == $(jq '.summary.requests' "$tmp/int.json") ]] || fail "interrupted run lost requests"
echo "ok: Ctrl-C after $n requests"
echo PASS
