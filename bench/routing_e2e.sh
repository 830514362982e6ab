#!/usr/bin/env bash
# Issue-9 routing benchmark: replay traces against N workers behind `kvserve router`, once per
# policy, plus one worker alone (the reuse upper bound: every turn finds its history cached).
# Each setup starts fresh workers (cold caches) and replays the same saved trace with the same
# client (kvserve bench, --conversation-id, completions API). Reports req/s, TTFT p50/p90,
# cached-token ratio and its share of the single-worker ratio, the busiest worker's share over
# the mean, and throughput over round robin's (docs/benchmarks.md "Routing").
#   bench/routing_e2e.sh [--model PATH] [--workers 4] [--threads 1] [--concurrency 8]
#                        [--sessions 16] [--traces synthetic,mtbench,hh-rlhf]
#                        [--policies round_robin,least_loaded,kv_aware,conversation]
#                        (kv_aware-bN: kv_aware with --kv-balance-threshold N)
#                        [--synthetic "kvserve bench options of the agentic trace"]
#                        [--kv-cache-mib 256] (per worker; the single worker gets N times as much,
#                        the pool's total, so it is the upper bound: it never evicts what 4 keep)
# Default model: the random-weight 12x768 Llama (made once with bench_engine), --max-model-len 2048.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD:-$root/build}
data=${KVSERVE_TEST_DATA:-$root/../shared/data}
model="" nw=4 threads=1 conc=8 sessions=16 traces=synthetic,mtbench,hh-rlhf
policies=round_robin,least_loaded,kv_aware,conversation out=${OUT:-/tmp/kvserve-routing-bench}
maxlen=2048 kvmib=256
syn="--turns 6 --system-tokens 384 --shared-fraction 1.0 --user-tokens 24 --tool-tokens 96 --output-tokens 24"
while (($#)); do
  case $1 in
    --model) model=$2; shift 2 ;; --workers) nw=$2; shift 2 ;; --threads) threads=$2; shift 2 ;;
    --concurrency) conc=$2; shift 2 ;; --sessions) sessions=$2; shift 2 ;; --traces) traces=$2; shift 2 ;;
    --policies) policies=$2; shift 2 ;; --max-model-len) maxlen=$2; shift 2 ;;
    --synthetic) syn=$2; shift 2 ;; --kv-cache-mib) kvmib=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
if [[ -z $model ]]; then
  cache=${KVSERVE_BENCH_CACHE:-$HOME/.cache/kvserve/bench}
  mkdir -p "$cache"
  model=$cache/bench-llama-12x768.gguf
  [[ -f $model ]] || "$build/bench_engine" --make-model "$model" --vocab-from \
    "$data/models/llama-2-tiny-random/llama-2-tiny-random.gguf" --layers 12 --dim 768 --heads 12 --kv-heads 12 --ffn 2048
fi
key=$out/hash.key
rm -f "$key"
# shellcheck source=bench/lib_procs.sh
source "$root/bench/lib_procs.sh"
wopts=(--model "$model" --max-model-len "$maxlen" --threads "$threads" --hash-key-file "$key")
single_mem=(--kv-cache-memory "$((kvmib * nw))MiB") worker_mem=(--kv-cache-memory "${kvmib}MiB")
trace_args() { # trace name -> kvserve bench workload options
  case $1 in
    synthetic) echo "--sessions $sessions $syn" ;;
    mtbench) echo "--dataset mtbench --dataset-sessions $sessions --max-tokens 32" ;;
    hh-rlhf) echo "--dataset hh-rlhf --dataset-sessions $sessions --max-tokens 32" ;;
    *) echo "unknown trace $1" >&2; exit 2 ;;
  esac
}
run() { # url label trace
  "$build/kvserve" bench --url "$1" --api completions --trace "$out/$3.jsonl" --conversation-id \
    --concurrency "$conc" --temperature 0 --quiet --out "$out/$3-$2.json" >/dev/null
}
echo "# $(date -u +%Y-%m-%dT%H:%MZ)  $(nproc) cores  $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)  isa: $(grep -o -m1 'avx512f' /proc/cpuinfo || echo avx2)  OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset}"
echo "# model $(basename "$model"), $nw workers x --threads $threads, --max-model-len $maxlen, --kv-cache-memory ${kvmib}MiB each (single worker $((kvmib * nw))MiB), concurrency $conc, $sessions sessions per trace"
printf 'trace\tsetup\treq/s\tTTFT p50 ms\tTTFT p90 ms\tcached ratio\tvs single\tmax share/mean\tvs round_robin req/s\tfailed\n'
IFS=, read -ra TR <<<"$traces"
IFS=, read -ra PO <<<"$policies"
for tr in "${TR[@]}"; do
  # shellcheck disable=SC2046
  "$build/kvserve" bench --api completions $(trace_args "$tr") --save-trace "$out/$tr.jsonl" --dry-run --quiet >/dev/null
  start single serve "${wopts[@]}" "${single_mem[@]}"
  [[ $tr == "${TR[0]}" ]] && echo "# worker: $(grep -m1 -o 'cpu backend.*' "$out/single.log")"
  run "http://127.0.0.1:$port" single "$tr"
  cleanup
  for pol in "${PO[@]}"; do
    urls=()
    for i in $(seq 0 $((nw - 1))); do
      start "w$i" serve "${wopts[@]}" "${worker_mem[@]}"
      urls+=("http://127.0.0.1:$port")
    done
    extra=() name=${pol%%-b*}
    [[ $name == kv_aware || $name == conversation ]] && extra=(--tokenizer "$model")
    [[ $pol == kv_aware-b* ]] && extra+=(--kv-balance-threshold "${pol#kv_aware-b}")
    start router router --workers "${urls[@]}" --policy "$name" --hash-key-file "$key" "${extra[@]}"
    run "http://127.0.0.1:$port" "$pol" "$tr"
    cleanup
  done
  python3 - "$out" "$tr" "${PO[@]}" "$nw" <<'EOF'
import json, sys
out, tr, pols = sys.argv[1], sys.argv[2], sys.argv[3:-1]
def load(label):
    return json.load(open("%s/%s-%s.json" % (out, tr, label)))["summary"]
single = load("single")
rr = load("round_robin") if "round_robin" in pols else None
for label in ["single"] + pols:
    s = load(label)
    w = list(s["workers"].values())
    nw = len(w) if label == "single" else max(len(w), int(sys.argv[-1]))
    share = max(w) / (sum(w) / nw) if w else 0
    cr = s["cached_ratio"] or 0
    vs = cr / single["cached_ratio"] if single["cached_ratio"] else 0
    vrr = s["request_throughput"] / rr["request_throughput"] if rr and rr["request_throughput"] else 0
    print("%s\t%s\t%.3f\t%.1f\t%.1f\t%.3f\t%.3f\t%.2f (%d workers)\t%.2f\t%d" % (
        tr, label, s["request_throughput"], s["ttft_ms"]["p50"] or 0, s["ttft_ms"]["p90"] or 0, cr, vs,
        share, len(w), vrr, s["failed"]))
EOF
  files=("$out/$tr-single.json")
  for pol in "${PO[@]}"; do files+=("$out/$tr-$pol.json"); done
  python3 "$root/bench/routing_reuse.py" "${files[@]}" >"$out/reuse-$tr.txt"
  "$build/kvserve" bench --compare "${files[@]}" --pool-workers "$nw" --plot "$out/chart-$tr" >"$out/compare-$tr.txt" ||
    echo "# chart of $tr failed (gnuplot?): see $out/chart-$tr/gnuplot.log"
done
echo "# per-setup JSON: $out/<trace>-<setup>.json; where each setup lost reuse against the single worker"
echo "# (bench/routing_reuse.py): $out/reuse-<trace>.txt; charts (kvserve bench --compare ... --plot):"
echo "# $out/chart-<trace>/compare.png"
