#!/usr/bin/env bash
# Tokenizer encode throughput, kvserve vs HF tokenizers, one thread each, identical ids required.
#   bench/bench_tokenizer.sh [BUILD_DIR] [TOKENIZER_NAMES...]     (default: build, all five)
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$src/build}; shift || true
names=("$@"); [[ ${#names[@]} -gt 0 ]] || names=(qwen3 llama3 mistral gpt2 llama2)
data=${KVSERVE_TEST_DATA:-$src/../shared/data}
text=$data/datasets/war-and-peace.txt
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cmake --build "$build" -j2 --target bench_tokenizer >/dev/null
export RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
for n in "${names[@]}"; do
  echo "== $n"
  "$build/bench_tokenizer" "$data/tokenizers/$n" "$text" --repeat 5 --ids "$out/c.jsonl"
  node "$src/bench/bench_tokenizer.mjs" "$data/tokenizers/$n/tokenizer.json" "$text" --repeat 5 --ids "$out/hf.jsonl"
  if cmp -s "$out/c.jsonl" "$out/hf.jsonl"; then echo "ids: identical ($(wc -l < "$out/c.jsonl") paragraphs)"
  else echo "ids: DIFFERENT"; exit 1; fi
done
