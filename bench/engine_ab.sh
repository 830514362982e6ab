#!/usr/bin/env bash
# Engine side by side with llama.cpp, runs interleaved (kvserve, llama.cpp, kvserve, ...) so that
# a shared machine's drift hits both alike: bench_engine (no HTTP) against llama-bench on the same
# GGUF, one compute thread, f16 KV, pp512 and tg64; prints each pair and the median of the
# per-pair ratios kvserve / llama.cpp.
#
#   bench/engine_ab.sh --llama-bench PATH [--bench-engine PATH] [--isa native|avx2] [--runs 5]
#                      [--threads 1] [--depth N] MODEL.gguf
# --isa avx2 sets KVSERVE_CPU_ISA=avx2 for kvserve; give an AVX2-only llama-bench build with it.
# --depth N compares decode only (64 tokens) after an N-token prompt: bench_engine --depth N
# against llama-batched-bench -npp N -ntg 64 -npl 1 (its S_TG; the binary next to llama-bench,
# as llama-bench builds before Feb 2025 have no -d), flash attention off (llama.cpp's default;
# its CPU flash attention measured 2.5-4x slower at 8k in this snapshot).
# Logs the kernels (bench_engine's line names the ISA, the quantized-matmul mode, the prefill
# kernel, OpenBLAS core and OPENBLAS_CORETYPE).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
be=${BENCH_ENGINE:-$root/build/bench_engine} lb=${LLAMA_BENCH:-} isa=native runs=5 threads=1 model="" depth=0
while (($#)); do
  case "$1" in
    --llama-bench) lb=$2; shift 2 ;;
    --bench-engine) be=$2; shift 2 ;;
    --isa) isa=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --depth) depth=$2; shift 2 ;;
    -h|--help) sed -n 2,15p "$0"; exit 0 ;;
    -*) echo "engine_ab.sh: unknown option $1" >&2; exit 2 ;;
    *) model=$1; shift ;;
  esac
done
[[ -n "$model" && -f "$model" ]] || { echo "engine_ab.sh: give a GGUF file" >&2; exit 2; }
[[ -x "$lb" ]] || { echo "engine_ab.sh: --llama-bench PATH is required (llama.cpp is never built here)" >&2; exit 2; }
[[ -x "$be" ]] || { echo "engine_ab.sh: bench_engine not found at $be" >&2; exit 2; }
command -v jq >/dev/null || { echo "engine_ab.sh: needs jq" >&2; exit 2; }
case "$isa" in native) unset KVSERVE_CPU_ISA ;; avx2) export KVSERVE_CPU_ISA=avx2 ;; *) echo "engine_ab.sh: --isa native|avx2" >&2; exit 2 ;; esac
"$be" --model "$model" --threads "$threads" --prompt-len 16 --gen-len 2 --concurrency 1 --kv-dtype f16 | sed -n 2p
if ((depth > 0)); then
  lbb=$(dirname "$lb")/llama-batched-bench
  [[ -x "$lbb" ]] || { echo "engine_ab.sh: --depth needs llama-batched-bench next to llama-bench ($lbb)" >&2; exit 2; }
  echo "decode after a $depth-token prompt (64 tokens), tok/s"
  echo "pair  kvserve  llama  ratio"
  tmp=$(mktemp); trap 'rm -f "$tmp"' EXIT
  s_tg() { "$lbb" -m "$model" -c $((depth + 128)) -b 2048 -ub 512 -npp "$depth" -ntg 64 -npl 1 -t "$threads" \
             -ctk f16 -ctv f16 "$@" 2>/dev/null | awk -F'|' -v d="$depth" '$2 + 0 == d {print $9 + 0}'; }
  for i in $(seq "$runs"); do
    k=$("$be" --model "$model" --threads "$threads" --depth "$depth" --gen-len 64 --concurrency 1 --kv-dtype f16 |
        tail -1 | awk '{print $4}')
    l=$(s_tg)
    awk -v i="$i" -v k="$k" -v l="$l" 'BEGIN { printf "%4d  %7.1f  %5.1f  %5.2f\n", i, k, l, k / l }' | tee -a "$tmp"
  done
  sort -n -k4 "$tmp" | awk '{a[NR] = $4} END {printf "median ratio %.2f\n", a[int((NR + 1) / 2)]}'
  exit 0
fi
echo "pair  kvserve pp512  llama pp512  ratio   kvserve tg64  llama tg64  ratio"
tmp=$(mktemp); trap 'rm -f "$tmp"' EXIT
for i in $(seq "$runs"); do
  read -r kpp ktg < <("$be" --model "$model" --threads "$threads" --prompt-len 512 --gen-len 64 --concurrency 1 \
                         --kv-dtype f16 | tail -1 | awk '{print $3, $4}')
  read -r lpp ltg < <("$lb" -m "$model" -t "$threads" -p 512 -n 64 -r 1 -ctk f16 -ctv f16 -o json 2>/dev/null |
                      jq -r '"\([.[]|select(.n_gen==0)|.avg_ts][0]) \([.[]|select(.n_prompt==0)|.avg_ts][0])"')
  awk -v i="$i" -v a="$kpp" -v b="$lpp" -v c="$ktg" -v d="$ltg" \
    'BEGIN { printf "%4d  %13.1f  %11.1f  %5.2f   %12.1f  %10.1f  %5.2f\n", i, a, b, a / b, c, d, c / d }' | tee -a "$tmp"
done
sort -n -k4 "$tmp" | awk '{a[NR] = $4} END {printf "median ratio pp512 %.2f", a[int((NR + 1) / 2)]}'
sort -n -k7 "$tmp" | awk '{a[NR] = $7} END {printf ", tg64 %.2f\n", a[int((NR + 1) / 2)]}'
