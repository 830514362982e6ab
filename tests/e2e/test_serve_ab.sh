#!/usr/bin/env bash
# bench/serve_ab.sh (issue 11) end to end on stories260K, without llama.cpp: usage errors exit 2;
# a run whose "llama-server" is a stand-in (a wrapper that maps llama-server's flags onto
# `kvserve serve`) fills both columns and the ratio, token counts from `usage` match
# max_tokens on both sides, and neither server is left running.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src="${KVSERVE_SRC:-$here/../..}"
bin="${KVSERVE_BIN:?KVSERVE_BIN not set}"
data="${KVSERVE_TEST_DATA:-$src/../shared/data}"
model="$data/models/stories260K/stories260K.gguf"
script="$src/bench/serve_ab.sh"
source "$here/lib.sh"
need_cmd jq curl python3
[[ -f $model ]] || skip_test "$model missing"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# 1. usage errors: exit 2 with a message, nothing started
expect_usage_error bash "$script" --kvserve "$bin"
expect_usage_error bash "$script" --kvserve "$bin" --bogus "$model"
expect_usage_error bash "$script" --kvserve "$bin" --isa sse2 --skip-llama "$model"
expect_usage_error bash "$script" --kvserve "$bin" --threads x --skip-llama "$model"
expect_usage_error bash "$script" --kvserve "$bin" --kv-dtype f8 --skip-llama "$model"
expect_usage_error bash "$script" --kvserve "$bin" --skip-llama "$tmp/no-such.gguf"
LLAMA_SERVER="" expect_usage_error bash "$script" --kvserve "$bin" "$model"
[[ $usage_err == *"llama-server not found"* ]] || fail "missing llama-server: $usage_err"
echo "ok: usage errors"

# 2. a stand-in llama-server: llama-server's flags mapped onto kvserve serve
fake=$tmp/llama-server
cat >"$fake" <<EOF
#!/usr/bin/env bash
args=()
while [[ \$# -gt 0 ]]; do
  case \$1 in
    -m) args+=(--model "\$2"); shift 2 ;;
    -t) args+=(--threads "\$2"); shift 2 ;;
    --host|--port) args+=("\$1" "\$2"); shift 2 ;;
    -c|--parallel|-fa) shift 2 ;;
    *) echo "stand-in llama-server: unexpected \$1" >&2; exit 2 ;;
  esac
done
exec "$bin" serve "\${args[@]}"
EOF
chmod +x "$fake"
rc=0
bash "$script" --kvserve "$bin" --llama-server "$fake" --threads 1 --ctx 256 --parallel 2 \
  --concurrency 2 --requests 2 --single-requests 1 --prompt-words 6 --max-tokens 4 --warmup 1 \
  --work-dir "$tmp/work" "$model" >"$tmp/table.md" 2>"$tmp/err" || rc=$?
[[ $rc == 0 ]] || fail "run exited $rc: $(cat "$tmp/err"; cat "$tmp/table.md")"
num='[0-9]+(\.[0-9]+)?'
for row in "1 stream: output tok/s" "1 stream: TPOT p50 ms" "2 streams: output tok/s" "2 streams: TTFT p50 ms"; do
  grep -Eq "^\| $row \| $num \| $num \| $num \|$" "$tmp/table.md" || fail "row '$row' not filled: $(cat "$tmp/table.md")"
done
for want in "llama c1: 1/1 ok, 4 output tokens" "llama c2: 2/2 ok, 8 output tokens" \
            "kvserve c1: 1/1 ok, 4 output tokens" "kvserve c2: 2/2 ok, 8 output tokens"; do
  grep -q "$want" "$tmp/table.md" || fail "token counts: no '$want' in $(grep 'token counts' "$tmp/table.md")"
done
grep -q MISMATCH "$tmp/table.md" && fail "token count mismatch reported"
grep -q "kernel [a-z0-9]*" "$tmp/table.md" || fail "kvserve kernel ISA not logged"
# both servers were stopped: their logs end with the clean stop
for log in "$tmp"/work/*-llama.log "$tmp"/work/*-kvserve.log; do
  grep -q "stopped cleanly" "$log" || fail "$log: server not stopped cleanly"
done
# the same prompts went to both: equal prompt token totals
p1=$(jq .summary.prompt_tokens "$tmp"/work/*-llama-c2.json)
p2=$(jq .summary.prompt_tokens "$tmp"/work/*-kvserve-c2.json)
[[ $p1 == "$p2" && $p1 -gt 0 ]] || fail "prompt tokens differ: $p1 vs $p2"
echo "ok: stand-in llama-server and kvserve, both columns, token counts"
