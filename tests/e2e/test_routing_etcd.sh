#!/usr/bin/env bash
# e2e: etcd discovery (kvserve serve --etcd registers, kvserve router --etcd watches) against a
# throwaway etcd on loopback (Debian etcd-server). Skipped (exit 77) when etcd is missing or
# cannot start.
exec bash "$(dirname "$0")/run_python_e2e.sh" routing.py etcd
