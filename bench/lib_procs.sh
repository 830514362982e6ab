# Sourced by the end-to-end benchmark scripts: start kvserve processes, stop them all.
# Needs $build (kvserve's build folder) and $out (logs, port files) set by the caller.
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; pids=(); }
trap cleanup EXIT
# start NAME kvserve-args... : runs kvserve in the background and sets $port to its bound port
# (exits when the process does not start). Not in a subshell: $pids must see the process.
start() {
  local name=$1; shift
  rm -f "$out/$name.port"
  "$build/kvserve" "$@" --port 0 --port-file "$out/$name.port" >"$out/$name.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 600); do [[ -s $out/$name.port ]] && break; sleep 0.1; done
  [[ -s $out/$name.port ]] || { echo "$name did not start: $(tail -3 "$out/$name.log")" >&2; exit 1; }
  port=$(cat "$out/$name.port")
}
