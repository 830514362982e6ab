#!/usr/bin/env bash
# libFuzzer targets of tests/fuzz (docs/testing.md):
#   run.sh build DIR            configure + build the fuzzers in DIR (clang, -DKVSERVE_FUZZ=ON)
#   run.sh run DIR TARGET [S]   TARGET's regression inputs (tests/fuzz/regressions/TARGET), then
#                               S seconds of fuzzing (default $KVSERVE_FUZZ_SECONDS or 15) from
#                               the seeds (tests/fuzz/corpus/TARGET; for gguf and tokenizer_json
#                               generated into DIR/seeds/TARGET by make_seeds.py, since model and
#                               tokenizer files are not tracked) plus DIR/corpus/TARGET, where new
#                               inputs are kept (never in the repository).
# A crash, leak or timeout fails with the input saved in DIR/artifacts/; add it to
# tests/fuzz/regressions/TARGET/ once fixed, so every later run replays it.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$here/../.." && pwd)
source "$src/tests/e2e/lib.sh"
cmd=${1:?usage: run.sh build DIR | run.sh run DIR TARGET [SECONDS]}
dir=${2:?build directory}
case "$cmd" in
build)
  need_cmd clang
  [[ -n "$(ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a 2>/dev/null)" ]] ||
    missing_dep "libFuzzer runtime (libclang-rt-dev) not installed"
  CC=clang cmake -S "$src" -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVSERVE_FUZZ=ON \
    -DKVSERVE_TESTS=OFF -DKVSERVE_WERROR=OFF -DKVSERVE_CUDA=OFF >/dev/null
  cmake --build "$dir" --target fuzzers -j"${JOBS:-2}"
  ;;
run)
  t=${3:?target}
  secs=${4:-${KVSERVE_FUZZ_SECONDS:-15}}
  bin="$dir/fuzz_$t"
  [[ -x "$bin" ]] || { echo "FAIL: $bin not built (run.sh build $dir)"; exit 1; }
  mkdir -p "$dir/corpus/$t" "$dir/artifacts"
  regs=("$here/regressions/$t"/*)
  if [[ -e "${regs[0]}" ]]; then
    echo "replaying ${#regs[@]} regression input(s)"
    "$bin" -timeout=20 -rss_limit_mb=2048 "${regs[@]}"
  fi
  # -max_len: big enough for the seeds; -timeout: a single input over 20 s is a hang
  seeds=()
  [[ -d "$here/corpus/$t" ]] && seeds+=("$here/corpus/$t")
  if [[ "$t" == gguf || "$t" == tokenizer_json ]]; then
    python3 "$here/make_seeds.py" "$dir" "$t"
    seeds+=("$dir/seeds/$t")
  fi
  "$bin" -max_total_time="$secs" -timeout=20 -rss_limit_mb=2048 -max_len=16384 -print_final_stats=1 \
    -artifact_prefix="$dir/artifacts/$t-" "$dir/corpus/$t" "${seeds[@]}"
  ;;
*) echo "usage: run.sh build DIR | run.sh run DIR TARGET [SECONDS]"; exit 2 ;;
esac
