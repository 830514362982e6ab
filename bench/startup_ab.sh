#!/usr/bin/env bash
# Time-to-ready of `kvserve serve` against llama-server on the same GGUF, alternated.
# Prints one line per start: server, seconds until /health answers 200, seconds until the
# first completion (1 token) returns, VmRSS (MiB) after that completion.
# usage: bench/startup_ab.sh MODEL.gguf [runs=3] [threads=2]
# env: KVSERVE (default build/kvserve), LLAMA_SERVER (default
#      ../peers/llama.cpp/build/bin/llama-server), PORT (default 18431), EXTRA_KV (extra
#      kvserve flags), ENV_KV (env assignments for kvserve, e.g. "KVSERVE_CPU_PREPACK=0")
set -u
model=${1:?usage: $0 MODEL.gguf [runs] [threads]}
runs=${2:-3}
threads=${3:-2}
kv=${KVSERVE:-build/kvserve}
ls_=${LLAMA_SERVER:-../peers/llama.cpp/build/bin/llama-server}
port=${PORT:-18431}
now() { date +%s.%N; }
one() { # name, command...
    local name=$1; shift
    local t0 t1 t2 pid rss
    t0=$(now)
    "$@" >/tmp/startup_ab.$$.log 2>&1 &
    pid=$!
    until [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/health")" = 200 ]; do
        if ! kill -0 "$pid" 2>/dev/null; then echo "$name: exited early" >&2; tail -5 /tmp/startup_ab.$$.log >&2; return 1; fi
        sleep 0.02
    done
    t1=$(now)
    curl -s -o /dev/null -H 'Content-Type: application/json' \
        -d '{"prompt":"Once upon a time","max_tokens":1,"temperature":0}' "http://127.0.0.1:$port/v1/completions"
    t2=$(now)
    rss=$(awk '/^VmRSS/{print int($2/1024)}' "/proc/$pid/status")
    kill -TERM "$pid"; wait "$pid" 2>/dev/null
    printf '%-12s health %6.2f s  first completion %6.2f s  VmRSS %5d MiB  load %s\n' "$name" \
        "$(echo "$t1 - $t0" | bc)" "$(echo "$t2 - $t0" | bc)" "$rss" "$(cut -d' ' -f1 /proc/loadavg)"
}
for ((r = 0; r < runs; r++)); do
    one kvserve env ${ENV_KV:-} "$kv" serve --model "$model" --threads "$threads" --port "$port" ${EXTRA_KV:-}
    one llama-server "$ls_" -m "$model" -t "$threads" -c 512 --port "$port"
done
rm -f /tmp/startup_ab.$$.log
