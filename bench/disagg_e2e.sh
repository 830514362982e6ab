#!/usr/bin/env bash
# Issue-8 end-to-end benchmark: TTFT / TPOT of the aggregated worker vs 1 context + 1 generation
# worker behind kvserve router, on the random-weight 12x768 Llama, long prompts (war-and-peace
# excerpts of --prompt-words words, about 2k tokens), C concurrent streams, same client
# (kvserve bench), same run. Both setups get the same cores (each worker --threads T).
#   bench/disagg_e2e.sh [--words 1500] [--concurrency 8] [--sessions 16] [--threads 2] [--transport ucx|tcp]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD:-$root/build}
data=${KVSERVE_TEST_DATA:-$root/../shared/data}
words=1500 conc=8 sessions=16 threads=2 transport=ucx out=${OUT:-/tmp/kvserve-disagg-bench}
while (($#)); do
  case $1 in
    --words) words=$2; shift 2 ;; --concurrency) conc=$2; shift 2 ;; --sessions) sessions=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;; --transport) transport=$2; shift 2 ;; *) echo "unknown $1"; exit 2 ;;
  esac
done
mkdir -p "$out"
cache=${KVSERVE_BENCH_CACHE:-$HOME/.cache/kvserve/bench}
mkdir -p "$cache"
big=$cache/bench-llama-12x768.gguf
[[ -f $big ]] || "$build/bench_engine" --make-model "$big" --vocab-from \
  "$data/models/llama-2-tiny-random/llama-2-tiny-random.gguf" --layers 12 --dim 768 --heads 12 --kv-heads 12 --ffn 2048
# shellcheck source=bench/lib_procs.sh
source "$root/bench/lib_procs.sh"
common=(--model "$big" --max-model-len 4096 --threads "$threads" --kv-cache-memory 2GiB --no-prefix-cache)
bench() { # url label
  "$build/kvserve" bench --url "$1" --api completions --dataset war-and-peace --prompt-words "$words" \
    --dataset-sessions "$sessions" --num-sessions "$sessions" --concurrency "$conc" --max-tokens 64 \
    --ignore-eos --temperature 0 --quiet --out "$out/$2.json" >/dev/null
  jq -r --arg l "$2" '.summary | [$l, (.ttft_ms.p50|tostring), (.ttft_ms.p90|tostring), (.tpot_ms.p50|tostring), (.itl_ms.p50|tostring), (.output_token_throughput|tostring), (.failed|tostring)] | @tsv' "$out/$2.json"
}
echo "# $(date -u +%Y-%m-%dT%H:%MZ)  $(nproc) cores  $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)  isa: $(grep -o -m1 'avx512f' /proc/cpuinfo || echo avx2)  OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset}"
echo "# words/prompt $words, concurrency $conc, sessions $sessions, 64 output tokens, --threads $threads per worker, kv transport $transport"
printf 'setup\tTTFT p50 ms\tTTFT p90 ms\tTPOT p50 ms\tITL p50 ms\toutput tok/s\tfailed\n'
start agg serve "${common[@]}"
bench "http://127.0.0.1:$port" aggregated
cleanup
start ctx serve "${common[@]}" --role context --kv-transport "$transport"
pc=$port
start gen serve "${common[@]}" --role generation --kv-transport "$transport"
pg=$port
start router router --context "http://127.0.0.1:$pc" --generation "http://127.0.0.1:$pg"
bench "http://127.0.0.1:$port" "disagg-1+1-$transport"
