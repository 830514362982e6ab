#!/usr/bin/env bash
# e2e: kvserve router against fake workers (tests/e2e/fake_worker.py), the "flows" cases of
# tests/e2e/router_e2e.py. Needs only python3 (no model).
exec bash "$(dirname "$0")/run_python_e2e.sh" router_e2e.py flows "$@"
