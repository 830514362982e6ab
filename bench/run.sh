#!/usr/bin/env bash
# Issue-2 benchmark: prefill and decode tokens/s of the engine + CPU backend on stories260K and
# on a random-weight Llama (12 layers, hidden 768, Llama-2 32k vocabulary), for 1 and 16
# concurrent requests. When llama.cpp's tools are found ($LLAMA_CPP_BIN, default
# /tmp/llamacpp/build/bin), the same GGUF files are measured with llama-bench (1 sequence) and
# llama-batched-bench (16 sequences) in the same run.
#   bench/run.sh [--threads N]      results go to stdout; copy them into docs/benchmarks.md
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD:-$root/build}
data=${KVSERVE_TEST_DATA:-$root/../shared/data}
threads=2
[[ "${1:-}" == "--threads" ]] && threads=$2
cache=${KVSERVE_BENCH_CACHE:-$HOME/.cache/kvserve/bench}
mkdir -p "$cache"
cmake --build "$build" --target bench_engine -j"$(nproc)" >/dev/null
big=$cache/bench-llama-12x768.gguf
if [[ ! -f $big ]]; then
  "$build/bench_engine" --make-model "$big" --vocab-from "$data/models/llama-2-tiny-random/llama-2-tiny-random.gguf" \
    --layers 12 --dim 768 --heads 12 --kv-heads 12 --ffn 2048
fi
llama=${LLAMA_CPP_BIN:-/tmp/llamacpp/build/bin}
echo "# $(date -u +%Y-%m-%dT%H:%MZ)  $(nproc) cores  $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
for m in "$data/models/stories260K/stories260K.gguf" "$big"; do
  echo "## kvserve engine: $(basename "$m")"
  "$build/bench_engine" --model "$m" --threads "$threads" --prompt-len 256 --gen-len 64 --concurrency 1,16
  if [[ -x $llama/llama-bench ]]; then
    echo "## llama.cpp llama-bench (1 sequence): $(basename "$m")"
    "$llama/llama-bench" -m "$m" -p 256 -n 64 -t "$threads" -r 3 2>/dev/null | grep -E '^\|'
    echo "## llama.cpp llama-batched-bench (1 and 16 sequences, pp 256, tg 64): $(basename "$m")"
    "$llama/llama-batched-bench" -m "$m" -c 8192 -b 2048 -ub 512 -npp 256 -ntg 64 -npl 1,16 -t "$threads" 2>/dev/null | grep -E '^\|'
  fi
done
