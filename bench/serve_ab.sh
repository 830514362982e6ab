#!/usr/bin/env bash
# Issue 11: kvserve side by side with llama.cpp on the same GGUF files (docs/benchmarks.md,
# "Side by side with llama.cpp (issue 11)").
#
# For each GGUF file, and for each ISA asked for (--isa native,avx2):
#   served: llama-server (-m FILE -t T -c CTX --parallel P -fa off) and then `kvserve serve` on
#     the same file with the same thread count; each gets the same seeded trace, replayed by
#     `kvserve bench` (completions API, greedy, ignore_eos, fixed max_tokens): a warm-up, one
#     stream of --single-requests requests, then --concurrency streams over --requests requests.
#   engine (--engine): llama-bench -p PP -n TG (and -d DEPTH with --depth) against
#     bench_engine --prompt-len PP --gen-len TG --concurrency 1 (no HTTP).
# Prints markdown (one table per file and ISA) on stdout; JSON of every run and the server logs
# stay in --work-dir. llama.cpp is never built here: give its binaries by path.
#
#   bench/serve_ab.sh --llama-server /path/to/llama-server [options] MODEL.gguf [MODEL.gguf ...]
#   bench/serve_ab.sh --help
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD:-$root/build}
kvserve=${KVSERVE_BIN:-}
bench_engine=${BENCH_ENGINE:-}
llama_server=${LLAMA_SERVER:-}
llama_server_avx2=${LLAMA_SERVER_AVX2:-}
llama_bench=${LLAMA_BENCH:-}
llama_bench_avx2=${LLAMA_BENCH_AVX2:-}
isas=native threads=$(( $(nproc) > 1 ? $(nproc) - 1 : 1 )) ctx=8192 parallel=16 conc=16 requests=32 single=8 prompt_words=120
max_tokens=64 seed=1 engine=0 engine_only=0 pp=512 tg=64 depth=0 reps=3 health_s=600 warmup=2
kv_dtype="" work_dir="" llama_args="" kvserve_args="" skip_llama=0 skip_kvserve=0

usage() {
  cat <<'EOF'
usage: bench/serve_ab.sh [options] MODEL.gguf [MODEL.gguf ...]

binaries (llama.cpp is given by path, never built by this script):
  --kvserve PATH            kvserve binary (default $KVSERVE_BIN, else $BUILD/kvserve; BUILD=build)
  --bench-engine PATH       bench_engine binary (default $BENCH_ENGINE, else beside kvserve)
  --llama-server PATH       llama-server (default $LLAMA_SERVER)
  --llama-server-avx2 PATH  llama-server of an AVX2-only build, for --isa avx2 ($LLAMA_SERVER_AVX2)
  --llama-bench PATH        llama-bench (default $LLAMA_BENCH, else beside llama-server)
  --llama-bench-avx2 PATH   ($LLAMA_BENCH_AVX2, else beside llama-server-avx2)
what to run:
  --isa LIST                native, avx2 or native,avx2 (default native). avx2 runs kvserve with
                            KVSERVE_CPU_ISA=avx2 (and OPENBLAS_CORETYPE=Haswell unless set) and the
                            AVX2-only llama.cpp build
  --engine                  also the engine section (llama-bench vs bench_engine)
  --engine-only             only the engine section
  --skip-llama, --skip-kvserve   leave one side out of the served section
served section:
  --threads N               compute threads of both servers (default: cores - 1, so that the
                            servers' HTTP threads and the client do not preempt a compute
                            thread; llama.cpp's threads spin at every op and lose a scheduler
                            slice each time one is preempted)
  --ctx N                   llama-server -c; kvserve gets the same KV size in tokens (default 8192)
  --parallel N              llama-server --parallel; kvserve --max-batch-size (default 16);
                            each request may use ctx/parallel tokens on both
  --concurrency N           streams of the multi-stream run (default 16)
  --requests N              requests of the multi-stream run (default 32)
  --single-requests N       requests of the one-stream run (default 8)
  --prompt-words N          words per prompt (default 120, ~128 Llama-2 tokens with the framing)
  --max-tokens N            tokens generated per request, EOS ignored (default 64)
  --warmup N                warm-up requests before the measured runs (default 2)
  --seed N                  trace seed (default 1)
  --kv-dtype f32|f16|bf16   the same KV cache type on both: llama-server/llama-bench -ctk T -ctv T,
                            kvserve serve --kv-cache-dtype T, bench_engine --kv-dtype T (default:
                            each tool's own default: llama.cpp f16, kvserve f32)
  --llama-args "ARGS"       extra llama-server arguments
  --kvserve-args "ARGS"     extra kvserve serve arguments
  --health-timeout S        seconds to wait for /health (default 600)
engine section:
  --pp N --tg N             prompt and generated tokens (default 512, 64)
  --depth D                 also llama-bench decode after D tokens of context (-d D); kvserve's
                            bench_engine has no such option, so its cell says n/a
  --reps N                  llama-bench -r (default 3)
output:
  --work-dir DIR            keep traces, JSON and logs there (default: a new temporary folder)
EOF
}

die() { echo "serve_ab: $*" >&2; exit 2; }
while [[ $# -gt 0 ]]; do
  case $1 in
    -h|--help) usage; exit 0 ;;
    --kvserve) kvserve=$2; shift 2 ;;
    --bench-engine) bench_engine=$2; shift 2 ;;
    --llama-server) llama_server=$2; shift 2 ;;
    --llama-server-avx2) llama_server_avx2=$2; shift 2 ;;
    --llama-bench) llama_bench=$2; shift 2 ;;
    --llama-bench-avx2) llama_bench_avx2=$2; shift 2 ;;
    --isa) isas=$2; shift 2 ;;
    --engine) engine=1; shift ;;
    --engine-only) engine=1; engine_only=1; shift ;;
    --skip-llama) skip_llama=1; shift ;;
    --skip-kvserve) skip_kvserve=1; shift ;;
    --threads) threads=$2; shift 2 ;;
    --ctx) ctx=$2; shift 2 ;;
    --parallel) parallel=$2; shift 2 ;;
    --concurrency) conc=$2; shift 2 ;;
    --requests) requests=$2; shift 2 ;;
    --single-requests) single=$2; shift 2 ;;
    --prompt-words) prompt_words=$2; shift 2 ;;
    --max-tokens) max_tokens=$2; shift 2 ;;
    --warmup) warmup=$2; shift 2 ;;
    --seed) seed=$2; shift 2 ;;
    --kv-dtype) kv_dtype=$2; shift 2 ;;
    --llama-args) llama_args=$2; shift 2 ;;
    --kvserve-args) kvserve_args=$2; shift 2 ;;
    --health-timeout) health_s=$2; shift 2 ;;
    --pp) pp=$2; shift 2 ;;
    --tg) tg=$2; shift 2 ;;
    --depth) depth=$2; shift 2 ;;
    --reps) reps=$2; shift 2 ;;
    --work-dir) work_dir=$2; shift 2 ;;
    --) shift; break ;;
    -*) die "unknown option '$1' (see --help)" ;;
    *) break ;;
  esac
done
[[ $# -ge 1 ]] || { usage >&2; exit 2; }
for n in "$threads" "$ctx" "$parallel" "$conc" "$requests" "$single" "$prompt_words" "$max_tokens" \
         "$warmup" "$seed" "$pp" "$tg" "$depth" "$reps" "$health_s"; do
  [[ $n =~ ^[0-9]+$ ]] || die "expected a non-negative integer, got '$n'"
done
(( threads >= 1 && parallel >= 1 && conc >= 1 && requests >= 1 && single >= 1 && max_tokens >= 2 )) ||
  die "threads, parallel, concurrency, requests, single-requests must be >= 1 and max-tokens >= 2"
(( ctx / parallel >= 16 )) || die "--ctx / --parallel must leave at least 16 tokens per request"
case $kv_dtype in ""|f32|f16|bf16) ;; *) die "--kv-dtype: expected f32, f16 or bf16, got '$kv_dtype'" ;; esac
llama_kv=() kvserve_kv=() engine_kv=()
if [[ -n $kv_dtype ]]; then
  llama_kv=(-ctk "$kv_dtype" -ctv "$kv_dtype")
  kvserve_kv=(--kv-cache-dtype "$kv_dtype")
  engine_kv=(--kv-dtype "$kv_dtype")
fi
for f in "$@"; do [[ -f $f ]] || die "no such model file: $f"; done
command -v jq >/dev/null || die "needs jq"
command -v curl >/dev/null || die "needs curl"
command -v python3 >/dev/null || die "needs python3 (free port)"

kvserve=${kvserve:-$build/kvserve}
[[ -x $kvserve ]] || die "kvserve binary not found at $kvserve (--kvserve or \$KVSERVE_BIN)"
bench_engine=${bench_engine:-$(dirname "$kvserve")/bench_engine}
[[ -z $llama_bench && -n $llama_server ]] && llama_bench=$(dirname "$llama_server")/llama-bench
[[ -z $llama_bench_avx2 && -n $llama_server_avx2 ]] && llama_bench_avx2=$(dirname "$llama_server_avx2")/llama-bench

IFS=, read -r -a isa_list <<<"$isas"
for isa in "${isa_list[@]}"; do
  case $isa in
    native) ls=$llama_server; lb=$llama_bench ;;
    avx2) ls=$llama_server_avx2; lb=$llama_bench_avx2 ;;
    *) die "--isa: unknown '$isa' (native, avx2)" ;;
  esac
  if (( ! engine_only && ! skip_llama )); then
    [[ -n $ls && -x $ls ]] || die "--isa $isa: llama-server not found ('$ls'; see --llama-server${isa/native/}${isa/avx2/-avx2})"
  fi
  if (( engine )); then
    [[ -n $lb && -x $lb ]] || die "--isa $isa: llama-bench not found ('$lb')"
    [[ -x $bench_engine ]] || die "bench_engine not found at $bench_engine (--bench-engine)"
  fi
done

if [[ -z $work_dir ]]; then work_dir=$(mktemp -d "${TMPDIR:-/tmp}/serve_ab.XXXXXX"); fi
mkdir -p "$work_dir"
server_pid=""
# shellcheck disable=SC2317  # called by the EXIT trap
cleanup() { [[ -n $server_pid ]] && stop_server; return 0; }
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'; }

# wait_health URL PID LOG: /health answers 200 within health_s seconds, or the server died.
wait_health() {
  local url=$1 pid=$2 log=$3 deadline=$((SECONDS + health_s))
  while (( SECONDS < deadline )); do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "serve_ab: server exited before it was healthy; last log lines:" >&2
      tail -n 20 "$log" >&2
      return 1
    fi
    [[ $(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$url/health" || true) == 200 ]] && return 0
    sleep 0.2
  done
  echo "serve_ab: $url/health not 200 after ${health_s}s; last log lines:" >&2
  tail -n 20 "$log" >&2
  return 1
}

stop_server() {
  local pid=$server_pid i
  server_pid=""
  [[ -n $pid ]] || return 0
  kill -TERM "$pid" 2>/dev/null || return 0
  for ((i = 0; i < 150; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null || true
}

# The trace: single-turn sessions, no system prompt, a "Task: " of prompt_words seeded words;
# the completions API frames it as "User: Task: ...\n\nAssistant:". Sent identically to both.
trace=$work_dir/trace.jsonl
"$kvserve" bench --sessions "$requests" --turns 1 --system-tokens 0 --user-tokens "$prompt_words" \
  --tool-tokens 0 --output-tokens "$max_tokens" --seed "$seed" --save-trace "$trace" --dry-run >/dev/null
warm=$work_dir/warmup.jsonl
"$kvserve" bench --sessions "$(( warmup > 0 ? warmup : 1 ))" --turns 1 --system-tokens 0 --user-tokens "$prompt_words" \
  --tool-tokens 0 --output-tokens "$max_tokens" --seed "$((seed + 1000))" --save-trace "$warm" --dry-run >/dev/null

# replay URL TAG: warm-up, one stream, then conc streams; JSON in $work_dir/TAG-{c1,cN}.json.
replay() {
  local url=$1 tag=$2
  local common=(--url "$url" --api completions --max-tokens "$max_tokens" --ignore-eos --temperature 0
                --timeout 600 --quiet)
  if (( warmup > 0 )); then
    "$kvserve" bench "${common[@]}" --trace "$warm" --concurrency "$warmup" >"$work_dir/$tag-warmup.txt" 2>&1 || true
  fi
  "$kvserve" bench "${common[@]}" --trace "$trace" --num-sessions "$single" --concurrency 1 \
    --out "$work_dir/$tag-c1.json" >"$work_dir/$tag-c1.txt" 2>&1 || { echo "serve_ab: $tag 1-stream run failed (see $work_dir/$tag-c1.txt)" >&2; return 1; }
  "$kvserve" bench "${common[@]}" --trace "$trace" --concurrency "$conc" \
    --out "$work_dir/$tag-c$conc.json" >"$work_dir/$tag-c$conc.txt" 2>&1 || { echo "serve_ab: $tag $conc-stream run failed (see $work_dir/$tag-c$conc.txt)" >&2; return 1; }
}

# run_llama FILE ISA TAG LLAMA_SERVER
run_llama() {
  local f=$1 isa=$2 tag=$3 bin=$4 port log
  port=$(free_port)
  log=$work_dir/$tag.log
  # flash attention off: newer llama-server takes `-fa off`; older ones (before the on|off|auto
  # form, e.g. early 2025) take `-fa` as an on switch and are off without it
  local fa=() help
  help=$("$bin" --help 2>&1 || true)
  [[ "$help" == *"--flash-attn [on|off"* || "$help" == *"--flash-attn FA"* ]] && fa=(-fa off)
  # shellcheck disable=SC2086  # llama_args is split on purpose
  nice -n 0 "$bin" -m "$f" -t "$threads" -c "$ctx" --parallel "$parallel" "${fa[@]}" \
    --host 127.0.0.1 --port "$port" "${llama_kv[@]}" $llama_args >"$log" 2>&1 &
  server_pid=$!
  wait_health "http://127.0.0.1:$port" "$server_pid" "$log" || { stop_server; return 1; }
  replay "http://127.0.0.1:$port" "$tag" || { stop_server; return 1; }
  stop_server
}

# run_kvserve FILE ISA TAG
run_kvserve() {
  local f=$1 isa=$2 tag=$3 log pf port i
  log=$work_dir/$tag.log
  pf=$work_dir/$tag.port
  rm -f "$pf"
  local env_isa=()
  if [[ $isa == avx2 ]]; then
    env_isa=(KVSERVE_CPU_ISA=avx2 OPENBLAS_CORETYPE="${OPENBLAS_CORETYPE:-Haswell}")
  fi
  # Same KV capacity as llama-server: ctx tokens in all, ctx/parallel per request.
  # shellcheck disable=SC2086
  env "${env_isa[@]}" "$kvserve" serve --model "$f" --threads "$threads" --host 127.0.0.1 --port 0 \
    --port-file "$pf" --max-batch-size "$parallel" --max-model-len "$((ctx / parallel))" \
    --kv-cache-blocks "$(( (ctx + 15) / 16 ))" --tokens-per-block 16 "${kvserve_kv[@]}" $kvserve_args >"$log" 2>&1 &
  server_pid=$!
  for ((i = 0; i < health_s * 10; i++)); do
    [[ -s $pf ]] && break
    kill -0 "$server_pid" 2>/dev/null || break
    sleep 0.1
  done
  if [[ ! -s $pf ]]; then
    echo "serve_ab: kvserve did not write its port; last log lines:" >&2
    tail -n 20 "$log" >&2
    stop_server
    return 1
  fi
  port=$(head -n1 "$pf")
  wait_health "http://127.0.0.1:$port" "$server_pid" "$log" || { stop_server; return 1; }
  replay "http://127.0.0.1:$port" "$tag" || { stop_server; return 1; }
  stop_server
}

jget() { [[ -f $1 ]] && jq -r "$2 // \"n/a\"" "$1" 2>/dev/null || echo n/a; }
fmt() { [[ $1 == n/a || -z $1 ]] && { echo n/a; return; }; printf "%.${2:-1}f" "$1"; }
ratio() { # ratio A B -> B/A with 2 decimals, n/a when either is missing or A is 0
  awk -v a="$1" -v b="$2" 'BEGIN { if (a == "n/a" || b == "n/a" || a + 0 == 0) print "n/a"; else printf "%.2f", b / a }'
}

cpu_flags=$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|fma|f16c|avx512f|avx512bw|avx512vl|avx512_vnni|avx512_bf16|avx512_fp16|avx_vnni|amx_tile)$' | tr '\n' ' ' || true)
cpu_model=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
# build_info BIN: where BIN was built from, read from the CMakeCache.txt of its build folder.
cache_of() { local d; d=$(cd "$(dirname "$1")" && pwd); for c in "$d/CMakeCache.txt" "$d/../CMakeCache.txt"; do [[ -f $c ]] && { echo "$c"; return; }; done; }
kvserve_info() {
  local c src rev
  c=$(cache_of "$kvserve")
  src=$([[ -n $c ]] && sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$c")
  if [[ -n $src ]] && rev=$(git -C "$src" rev-parse --short HEAD 2>/dev/null); then
    [[ -n $(git -C "$src" status --porcelain -uno 2>/dev/null) ]] && rev="$rev+uncommitted"
  elif [[ -n $src && -f $src/.commit ]]; then rev=$(cut -c1-7 "$src/.commit")
  else rev=unknown; fi
  echo "source ${src:-?} at $rev"
}
llama_info() { # the ISA options of a llama.cpp build
  local c
  c=$(cache_of "$1")
  [[ -n $c ]] || { echo "build options unknown"; return; }
  if grep -q '^GGML_NATIVE:BOOL=ON' "$c"; then echo "GGML_NATIVE=ON: -march=native"; return; fi
  grep -E '^GGML_(NATIVE|AVX|AVX2|AVX512|AVX512_VNNI|AVX512_BF16|FMA|F16C):BOOL=' "$c" | sed 's/:BOOL=/=/' | tr '\n' ' ' | sed 's/ $//'
}
echo "# serve_ab $(date -u +%Y-%m-%dT%H:%MZ)"
echo
echo "- machine: $(nproc) cores, $cpu_model; CPU flags: $cpu_flags"
echo "- kvserve: $kvserve ($(kvserve_info))"
[[ -n $llama_server ]] && echo "- llama.cpp: $llama_server ($(llama_info "$llama_server"))"
[[ -n $llama_server_avx2 ]] && echo "- llama.cpp AVX2 build: $llama_server_avx2 ($(llama_info "$llama_server_avx2"))"
if [[ -n $kv_dtype ]]; then echo "- KV cache: $kv_dtype on both (--kv-dtype)"
else echo "- KV cache: each tool's default (llama.cpp f16, kvserve f32)"; fi
echo "- OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset} (avx2 runs: ${OPENBLAS_CORETYPE:-Haswell}); work dir $work_dir"
if (( ! engine_only )); then
  echo "- served trace: $requests requests at $conc streams and the first $single at 1 stream, ${prompt_words}-word prompts (completions API), max_tokens $max_tokens with ignore_eos, temperature 0, seed $seed; $warmup warm-up requests first"
  echo "- llama-server -t $threads -c $ctx --parallel $parallel -fa off ${llama_kv[*]} $llama_args; kvserve serve --threads $threads --max-batch-size $parallel --max-model-len $((ctx / parallel)) --kv-cache-blocks $(( (ctx + 15) / 16 )) ${kvserve_kv[*]} $kvserve_args"
fi

status=0
checks=()
for f in "$@"; do
  fname=$(basename "$f")
  stem=${fname%.gguf}
  for isa in "${isa_list[@]}"; do
    if [[ $isa == native ]]; then ls=$llama_server; lb=$llama_bench; else ls=$llama_server_avx2; lb=$llama_bench_avx2; fi
    echo
    echo "## $fname ($(du -h "$f" | cut -f1)), ISA $isa"
    lt=$stem-$isa-llama kt=$stem-$isa-kvserve
    if (( ! engine_only )); then
      (( skip_llama )) || run_llama "$f" "$isa" "$lt" "$ls" || status=1
      (( skip_kvserve )) || run_kvserve "$f" "$isa" "$kt" || status=1
      kern=$(grep -o 'kernel [a-z0-9]*' "$work_dir/$kt.log" 2>/dev/null | head -n1 | cut -d' ' -f2 || true)
      obl=$(grep -o 'OpenBLAS core [A-Za-z0-9]*\|gemm openblas (core [A-Za-z0-9]*' "$work_dir/$kt.log" 2>/dev/null | head -n1 | awk '{print $NF}' || true)
      echo
      wts=$(grep -o 'weights [0-9.]* MiB, matrices [^)]*' "$work_dir/$kt.log" 2>/dev/null | head -n1 || true)
      kvt=$(grep -o 'KV cache ([a-z0-9]*)' "$work_dir/$kt.log" 2>/dev/null | head -n1 | tr -d '()' | awk '{print $NF}' || true)
      echo "kvserve: kernel ${kern:-?}, ${wts:-weights not logged by this build}, KV ${kvt:-f32}, OpenBLAS core ${obl:-?}$([[ $isa == avx2 ]] && echo ", KVSERVE_CPU_ISA=avx2, OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-Haswell}"); llama.cpp: $([[ -n $ls ]] && llama_info "$ls")"
      echo
      echo "| served ($fname, $threads threads, $isa) | llama.cpp | kvserve | kvserve/llama.cpp |"
      echo "|---|---|---|---|"
      row() { # label jq-path file-suffix digits
        local a b
        a=$(fmt "$(jget "$work_dir/$lt-$3.json" "$2")" "$4")
        b=$(fmt "$(jget "$work_dir/$kt-$3.json" "$2")" "$4")
        echo "| $1 | $a | $b | $(ratio "$a" "$b") |"
      }
      row "1 stream: output tok/s" .summary.output_token_throughput c1 1
      row "1 stream: TPOT p50 ms" .summary.tpot_ms.p50 c1 2
      row "1 stream: TTFT p50 ms" .summary.ttft_ms.p50 c1 1
      row "$conc streams: output tok/s" .summary.output_token_throughput "c$conc" 1
      row "$conc streams: TTFT p50 ms" .summary.ttft_ms.p50 "c$conc" 1
      row "$conc streams: TPOT p50 ms" .summary.tpot_ms.p50 "c$conc" 2
      # The check: both servers generated the same number of tokens for the same prompts.
      for side in llama kvserve; do
        t=$lt; [[ $side == kvserve ]] && t=$kt
        for run in c1 "c$conc"; do
          j=$work_dir/$t-$run.json
          [[ -f $j ]] || continue
          read -r ok n out pr <<<"$(jq -r '[.summary.ok, .summary.requests, .summary.output_tokens, .summary.prompt_tokens] | map(tostring) | join(" ")' "$j")"
          want=$(( requests * max_tokens ))
          [[ $run == c1 ]] && want=$(( single * max_tokens ))
          note=""
          [[ $out == "$want" && $ok == "$n" ]] || { note=" **MISMATCH (expected $want output tokens, all ok)**"; status=1; }
          checks+=("$side $run: $ok/$n ok, $out output tokens, $pr prompt tokens$note")
        done
      done
      echo
      printf 'token counts (usage):'; printf ' %s;' "${checks[@]}"; echo
      checks=()
    fi
    if (( engine )); then
      echo
      lbj=$work_dir/$stem-$isa-llama-bench.json
      dargs=()
      (( depth > 0 )) && dargs=(-d "0,$depth")
      "$lb" -m "$f" -p "$pp" -n "$tg" -t "$threads" -fa 0 -r "$reps" "${dargs[@]}" "${llama_kv[@]}" -o json >"$lbj" 2>"$work_dir/$stem-$isa-llama-bench.log" || { echo "serve_ab: llama-bench failed (see $work_dir/$stem-$isa-llama-bench.log)" >&2; status=1; }
      bel=$work_dir/$stem-$isa-bench_engine.txt
      env_isa=()
      [[ $isa == avx2 ]] && env_isa=(KVSERVE_CPU_ISA=avx2 OPENBLAS_CORETYPE="${OPENBLAS_CORETYPE:-Haswell}")
      env "${env_isa[@]}" "$bench_engine" --model "$f" --threads "$threads" --prompt-len "$pp" --gen-len "$tg" \
        --concurrency 1 "${engine_kv[@]}" >"$bel" 2>&1 || { echo "serve_ab: bench_engine failed (see $bel)" >&2; status=1; }
      lpp=$(jq -r --argjson p "$pp" '[.[] | select(.n_prompt == $p and .n_gen == 0 and ((.n_depth // 0) == 0)) | .avg_ts][0] // "n/a"' "$lbj" 2>/dev/null || echo n/a)
      ltg=$(jq -r --argjson g "$tg" '[.[] | select(.n_prompt == 0 and .n_gen == $g and ((.n_depth // 0) == 0)) | .avg_ts][0] // "n/a"' "$lbj" 2>/dev/null || echo n/a)
      ltgd=$(jq -r --argjson g "$tg" --argjson d "$depth" '[.[] | select(.n_prompt == 0 and .n_gen == $g and ((.n_depth // 0) == $d)) | .avg_ts][0] // "n/a"' "$lbj" 2>/dev/null || echo n/a)
      kpp=$(awk '$1 == "1" && NF == 4 { print $3 }' "$bel" | head -n1)
      ktg=$(awk '$1 == "1" && NF == 4 { print $4 }' "$bel" | head -n1)
      # "openblas core: X" (older bench_engine) or "kernel K (...), openblas core: X (...)"
      ecore=$(grep -o 'openblas core: [^ ,]*' "$bel" | head -n1 | awk '{print $NF}' || true)
      ekern=$(grep -o '^kernel [a-z0-9]*' "$bel" | head -n1 | awk '{print $NF}' || true)
      ekv=$(grep -o ', KV [a-z0-9]*$' "$bel" | head -n1 | awk '{print $NF}' || true)
      echo "bench_engine: kernel ${ekern:-? (not logged by this build)}, OpenBLAS core ${ecore:-?}, KV ${ekv:-f32}; llama-bench: $(jq -r '.[0] | "\(.cpu_info // "?"), backends \(.backends // "?"), type_k \(.type_k // "?")"' "$lbj" 2>/dev/null || echo ?)"
      echo
      echo "| engine ($fname, $threads threads, $isa) | llama-bench | bench_engine | kvserve/llama.cpp |"
      echo "|---|---|---|---|"
      a=$(fmt "${lpp:-n/a}"); b=$(fmt "${kpp:-n/a}"); echo "| pp$pp tok/s | $a | $b | $(ratio "$a" "$b") |"
      a=$(fmt "${ltg:-n/a}"); b=$(fmt "${ktg:-n/a}"); echo "| tg$tg tok/s (1 sequence) | $a | $b | $(ratio "$a" "$b") |"
      if (( depth > 0 )); then
        a=$(fmt "${ltgd:-n/a}"); echo "| tg$tg tok/s after $depth tokens | $a | n/a (bench_engine has no depth option) | n/a |"
      fi
    fi
  done
done
exit $status
