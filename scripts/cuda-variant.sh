#!/usr/bin/env bash
# A variant of bench_cuda and test_cuda_ops whose megakernel (src/backend/cuda/decode_mk.cu) is
# compiled with extra nvcc flags, linked beside an existing CUDA build without touching it, for
# A/B runs on the device in one call (docs/benchmarks.md, fourteenth session):
#
#   scripts/cuda-variant.sh OUTDIR "NVCC FLAGS" [BUILD]     e.g. scripts/cuda-variant.sh /tmp/cw11 -DMK_CW=11
#
# BUILD (default build-cuda) must hold a configured CUDA build with bench_cuda and test_cuda_ops
# built. Writes OUTDIR/bench_cuda and OUTDIR/test_cuda_ops (stripped). Only decode_mk.cu is
# recompiled: flags that other CUDA files would need to see as well do not belong here.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 OUTDIR \"NVCC FLAGS\" [BUILD]" >&2; exit 2; }
out=$1 flags=$2 build=${3:-build-cuda}
root=$(cd "$(dirname "$0")/.." && pwd)
[ -f "$root/$build/libkv_backend_cuda.a" ] && [ -f "$root/$build/CMakeFiles/bench_cuda.dir/linkLibs.rsp" ] ||
    { echo "$0: $build has no CUDA build (cmake -DKVSERVE_CUDA=ON; build bench_cuda test_cuda_ops)" >&2; exit 1; }
cd "$root/$build"
mkdir -p "$out/o"
out=$(cd "$out" && pwd)
cuda_flags=$(sed -n 's/^CUDA_FLAGS = //p' CMakeFiles/kv_backend_cuda.dir/flags.make)
# shellcheck disable=SC2086 # the flags are words
nvcc $cuda_flags $flags --options-file CMakeFiles/kv_backend_cuda.dir/includes_CUDA.rsp \
    -c "$root/src/backend/cuda/decode_mk.cu" -o "$out/o/decode_mk.cu.o"
cp libkv_backend_cuda.a "$out/libkv_backend_cuda.a"
(cd "$out/o" && ar r "$out/libkv_backend_cuda.a" decode_mk.cu.o)
for t in bench_cuda test_cuda_ops; do
    sed "s#libkv_backend_cuda.a#$out/libkv_backend_cuda.a#" "CMakeFiles/$t.dir/linkLibs.rsp" > "$out/$t.rsp"
    link=$(sed "s#@CMakeFiles/$t.dir/linkLibs.rsp#@$out/$t.rsp#; s#-o $t #-o $out/$t #" "CMakeFiles/$t.dir/link.txt")
    eval "$link"
    strip "$out/$t"
done
rm -rf "$out/o" "$out"/*.rsp "$out/libkv_backend_cuda.a"
echo "$out/bench_cuda $out/test_cuda_ops"
