#!/usr/bin/env bash
# Prefix token cache benchmark: per-request tokenization time of a ~38k-token multi-turn prompt
# growing by 1-2k tokens per turn, cached vs uncached (Llama-3 tokenizer).
# usage: bench/bench_prefix_cache.sh [BUILD_DIR] [bench args...]
set -euo pipefail
src="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-$src/build}"
shift || true
cmake --build "$build" -j2 --target bench_prefix_cache >/dev/null
export KVSERVE_TEST_DATA="${KVSERVE_TEST_DATA:-$src/../shared/data}"
exec "$build/bench_prefix_cache" "$@"
