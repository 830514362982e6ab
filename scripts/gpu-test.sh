#!/usr/bin/env bash
# GPU tests of the CUDA backend (issue 10) in one call, for a machine with an NVIDIA GPU.
#
#   scripts/gpu-test.sh [--bench] [--bench-args "ARGS"]       build build-gpu here, run test_cuda, test_cuda_ops
#        and test_cuda_ipc (the CUDA IPC KV transport between two processes on GPU 0)
#   (environment: SERVE_SMOKE=1 one completion through serve --backend cuda; E2E=1 the HTTP API
#   e2e suite, tests/e2e/http_api.py, against serve --backend cuda (counted; with bf16 weights
#   under its KVSERVE_E2E_TOL=bf16 tolerances, see its docstring); TORCH_REF=1 the PyTorch
#   reference, bench_cuda --torch-dump + tests/gpu/torch_ref.py, after test_cuda; DET_E2E=1
#   tests/gpu/det_serve.py: 16 concurrent greedy completions == each alone against serve
#   --backend cuda --deterministic (its status counts), then without --deterministic (printed);
#   DISAGG_E2E=1 tests/gpu/disagg_cuda.py: router + context + generation workers, all --backend
#   cuda on GPU 0, KV over CUDA IPC: greedy tokens == the aggregated cuda worker's on the public
#   stories260K reference prompts (bf16 and f32 KV), mixed cuda/cpu pairs refused (counted);
#   IPC_BENCH=1 bench_cuda_ipc (CUDA IPC transfer GB/s vs cudaMemcpyAsync D2D; with --bench);
#   FAULT_E2E=1 tests/gpu/fault_serve.py: injected CUDA faults (KVSERVE_CUDA_FAULT) fail their
#   requests with a 500 error JSON / an SSE error event and the server keeps serving (counted);
#   HF_BENCH=1 bench/hf_decode.py after bench_cuda (PyTorch + transformers on the same shapes,
#   with HF_BENCH_ARGS; bench_cuda's table is passed in for the side-by-side table);
#   KVSERVE_CUDA_TESTS=PATTERN runs only the test_cuda tests matching it, cmocka's filter with
#   * and ? wildcards, e.g. '*quant*')
#   scripts/gpu-test.sh --prebuilt DIR [--bench] ...          run binaries from DIR (no build)
#   scripts/gpu-test.sh --bundle DIR [--build BUILD]          (on the build machine) put test_cuda,
#        bench_cuda, their non-system shared libraries and the test data they read into DIR,
#        for a GPU machine that lacks kvserve's -dev packages (then carry DIR, or DIR.tar.gz, also
#        written, when DIR passes the 64 MiB a device call carries, and use --prebuilt),
#        and under DIR/overlay the scripts this checkout runs there (this file, http_api.py,
#        tests/gpu/*.py, bench/hf_decode.py: `cp -r DIR/overlay/. .` when the GPU machine gets
#        another checkout)
#
# Test data: $KVSERVE_TEST_DATA (default ../shared/data, or DIR/data with --prebuilt).
# Exit status: 0 when test_cuda and test_cuda_ops (every test passed or skipped with a SKIP: line) and each
# counted suite above passed; else the first failing one's status.
set -uo pipefail
cd "$(dirname "$0")/.."
prebuilt="" bundle="" build="build-cuda" bench=0 bench_args=""
while [ $# -gt 0 ]; do
    case "$1" in
    --prebuilt) prebuilt="$2"; shift 2 ;;
    --bundle) bundle="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    --bench) bench=1; shift ;;
    --bench-args) bench_args="$2"; bench=1; shift 2 ;;
    *) echo "usage: $0 [--prebuilt DIR | --bundle DIR [--build BUILD]] [--bench] [--bench-args ARGS]" >&2; exit 2 ;;
    esac
done

if [ -n "$bundle" ]; then
    data="${KVSERVE_TEST_DATA:-../shared/data}"
    rm -rf "$bundle" && mkdir -p "$bundle/lib" "$bundle/data/models/stories260K" "$bundle/data/references/stories260K" \
        "$bundle/data/models/tiny-quant"
    cp "$build/test_cuda" "$build/test_cuda_ops" "$build/test_cuda_ipc" "$build/bench_cuda" "$build/bench_cuda_ipc" \
        "$build/kvserve" "$bundle/" || exit 1
    # debug info stays here: the device call carries 64 MiB at most (kernel names survive: they
    # are in the CUDA fatbinary)
    strip "$bundle/test_cuda" "$bundle/test_cuda_ops" "$bundle/test_cuda_ipc" "$bundle/bench_cuda" \
        "$bundle/bench_cuda_ipc" "$bundle/kvserve" 2>/dev/null
    # shared libraries that are not glibc / libstdc++ / CUDA / OpenBLAS (the GPU machine has those);
    # --prebuilt drops the ones the GPU machine has itself
    ldd "$build/test_cuda" "$build/test_cuda_ops" "$build/test_cuda_ipc" "$build/bench_cuda" "$build/kvserve" | awk '/=> \//{print $3}' | sort -u |
        grep -vE '/(libc|libm|libdl|librt|libpthread|libstdc\+\+|libgcc_s|libcublas|libcublasLt|libcudart|libopenblas|libgfortran|libquadmath)\.so' |
        while read -r l; do cp -L "$l" "$bundle/lib/"; done
    cp "$data/models/stories260K/stories260K.gguf" "$bundle/data/models/stories260K/"
    cp "$data/references/stories260K/"* "$bundle/data/references/stories260K/"
    cp -r "$data/models/stories260K/hf" "$bundle/data/models/stories260K/"
    # test_cuda_quant_gguf's files (absent: that test skips with a SKIP: line)
    for q in F16 Q8_0 Q4_K_M; do
        cp "$data/models/tiny-quant/tiny-$q.gguf" "$bundle/data/models/tiny-quant/" ||
            echo "gpu-test.sh: tiny-$q.gguf not bundled: test_cuda_quant_gguf will skip" >&2
    done
    # the scripts this checkout runs on the GPU machine (a run there may start from another
    # checkout: `cp -r DIR/overlay/. .` first)
    mkdir -p "$bundle/overlay/scripts" "$bundle/overlay/tests/e2e" "$bundle/overlay/tests/gpu" "$bundle/overlay/bench"
    cp scripts/gpu-test.sh "$bundle/overlay/scripts/"
    cp tests/e2e/http_api.py tests/e2e/disagg.py "$bundle/overlay/tests/e2e/"
    cp tests/gpu/*.py "$bundle/overlay/tests/gpu/"
    cp bench/hf_decode.py "$bundle/overlay/bench/"
    printf '#!/bin/sh\n# kvserve with --backend cuda added to serve (for the e2e suites)\nd=$(dirname "$0")\nif [ "$1" = serve ]; then shift; exec "$d/kvserve" serve --backend cuda "$@"; fi\nexec "$d/kvserve" "$@"\n' > "$bundle/kvserve-cuda"
    chmod +x "$bundle/kvserve-cuda"
    du -sh "$bundle"
    # the device call carries 64 MiB at most: the stripped binaries with their CUDA fatbinaries
    # passed that (75 MB), so a compressed copy travels instead (carry DIR.tar.gz, then on the
    # GPU machine: tar xzf DIR.tar.gz && scripts/gpu-test.sh --prebuilt DIR)
    tar czf "$bundle.tar.gz" -C "$(dirname "$bundle")" "$(basename "$bundle")" && du -sh "$bundle.tar.gz"
    exit 0
fi

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "nvidia-smi failed"
if [ -n "$prebuilt" ]; then
    bin="$prebuilt"
    mkdir -p "$prebuilt/lib.system"
    for l in "$prebuilt"/lib/*.so*; do # prefer the machine's own copy of a library
        [ -e "$l" ] || continue
        if ldconfig -p | grep -q "$(basename "$l") "; then mv "$l" "$prebuilt/lib.system/"; fi
    done
    echo "carried libraries used: $(ls "$prebuilt/lib" | tr '\n' ' ')"
    export LD_LIBRARY_PATH="$prebuilt/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
    export KVSERVE_TEST_DATA="${KVSERVE_TEST_DATA:-$prebuilt/data}"
else
    bin="build-gpu"
    cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVSERVE_CUDA=ON >/dev/null || exit 1
    cmake --build build-gpu -j"$(nproc)" --target test_cuda test_cuda_ops test_cuda_ipc bench_cuda bench_cuda_ipc kvserve ||
        exit 1
    export KVSERVE_TEST_DATA="${KVSERVE_TEST_DATA:-$PWD/../shared/data}"
fi
if [ "${SERVE_SMOKE:-0}" = 1 ]; then # kvserve serve --backend cuda answers a completion
    echo "== serve --backend cuda smoke"
    pf=$(mktemp)
    "$bin/kvserve" serve --backend cuda --model "$KVSERVE_TEST_DATA/models/stories260K/stories260K.gguf" \
        --port 0 --port-file "$pf" > /tmp/serve.log 2>&1 &
    spid=$!
    for _ in $(seq 100); do [ -s "$pf" ] && break; sleep 0.1; done
    port=$(cat "$pf")
    curl -s -m 20 "http://127.0.0.1:$port/v1/completions" -H 'content-type: application/json' \
        -d '{"prompt":"Once upon a time","max_tokens":32,"temperature":0}'
    echo
    kill "$spid"; wait "$spid" 2>/dev/null
    tail -5 /tmp/serve.log
fi
if [ "${E2E:-0}" = 1 ]; then # the HTTP API e2e suite against serve --backend cuda
    echo "== e2e http_api against --backend cuda (weights ${KVSERVE_CUDA_WEIGHTS:-bf16})"
    if [ -n "$prebuilt" ]; then cuda_bin="$(cd "$prebuilt" && pwd)/kvserve-cuda"; else
        cuda_bin="$PWD/build-gpu/kvserve-cuda"
        printf '#!/bin/sh\nd=$(dirname "$0")\nif [ "$1" = serve ]; then shift; exec "$d/kvserve" serve --backend cuda "$@"; fi\nexec "$d/kvserve" "$@"\n' > "$cuda_bin"
        chmod +x "$cuda_bin"
        cmake --build build-gpu -j"$(nproc)" --target kvserve || exit 1
    fi
    # bf16 weights: greedy tokens may leave llama.cpp's fp32 ones at a near-tie (http_api.py)
    tol=bf16
    [ "${KVSERVE_CUDA_WEIGHTS:-bf16}" = f32 ] && tol=""
    KVSERVE_E2E_TOL="$tol" KVSERVE_BIN="$cuda_bin" python3 tests/e2e/http_api.py
    erc=$?
    echo "== e2e http_api exit $erc"
fi
echo "== test_cuda"
"$bin/test_cuda"
rc=$?
echo "== test_cuda exit $rc"
echo "== test_cuda_ops"
"$bin/test_cuda_ops"
orc=$?
echo "== test_cuda_ops exit $orc"
[ "$rc" = 0 ] && rc=$orc
echo "== test_cuda_ipc"
"$bin/test_cuda_ipc"
irc=$?
echo "== test_cuda_ipc exit $irc"
[ "$irc" = 77 ] && irc=0 # skipped (a SKIP: line says why), as test_cuda's skips
[ "$rc" = 0 ] && rc=$irc
if [ "${DISAGG_E2E:-0}" = 1 ]; then # disaggregated serving over CUDA IPC (issue 10)
    echo "== disagg_cuda: router + context + generation --backend cuda on GPU 0, KV over CUDA IPC"
    PYTHONUNBUFFERED=1 python3 tests/gpu/disagg_cuda.py "$bin/kvserve"
    grc=$?
    echo "== disagg_cuda exit $grc"
    [ "$rc" = 0 ] && rc=$grc
fi
[ "$rc" = 0 ] && [ -n "${erc:-}" ] && rc=$erc
if [ "${FAULT_E2E:-0}" = 1 ]; then # CUDA faults fail requests with 500, the server keeps serving
    echo "== fault_serve: KVSERVE_CUDA_FAULT against serve --backend cuda"
    python3 tests/gpu/fault_serve.py "$bin/kvserve" "$KVSERVE_TEST_DATA/models/stories260K/stories260K.gguf"
    frc=$?
    echo "== fault_serve exit $frc"
    [ "$rc" = 0 ] && rc=$frc
fi
if [ "${DET_E2E:-0}" = 1 ]; then # batch invariance end to end (issue 10)
    echo "== det_serve: serve --backend cuda --deterministic, 16 concurrent greedy requests vs alone"
    python3 tests/gpu/det_serve.py "$bin/kvserve" "$KVSERVE_TEST_DATA/models/stories260K/stories260K.gguf" \
        --backend cuda --deterministic
    drc=$?
    echo "== det_serve exit $drc"
    [ "$rc" = 0 ] && rc=$drc
    echo "== det_serve (not counted): default mode"
    python3 tests/gpu/det_serve.py "$bin/kvserve" "$KVSERVE_TEST_DATA/models/stories260K/stories260K.gguf" \
        --backend cuda
    echo "== det_serve default exit $?"
fi
if [ "${TORCH_REF:-0}" = 1 ]; then
    echo "== PyTorch reference (bench_cuda --torch-dump, tests/gpu/torch_ref.py)"
    tr=$(mktemp -d)
    "$bin/bench_cuda" --torch-dump "$tr" && python3 tests/gpu/torch_ref.py "$tr"
    trc=$?
    echo "== torch_ref exit $trc"
    rm -rf "$tr"
    [ "$rc" = 0 ] && rc=$trc
fi
if [ "$bench" = 1 ]; then
    echo "== bench_cuda $bench_args"
    # shellcheck disable=SC2086
    "$bin/bench_cuda" $bench_args | tee /tmp/bench_cuda.out
    echo "== bench_cuda exit ${PIPESTATUS[0]}"
    if [ "${IPC_BENCH:-0}" = 1 ]; then
        echo "== bench_cuda_ipc"
        "$bin/bench_cuda_ipc"
        echo "== bench_cuda_ipc exit $?"
    fi
    if [ "${HF_BENCH:-0}" = 1 ]; then
        echo "== hf_decode (PyTorch + transformers) ${HF_BENCH_ARGS:-}"
        # shellcheck disable=SC2086
        PYTHONUNBUFFERED=1 python3 bench/hf_decode.py ${HF_BENCH_ARGS:-} --kvserve-table /tmp/bench_cuda.out
        echo "== hf_decode exit $?"
    fi
fi
exit $rc
