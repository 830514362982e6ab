#!/usr/bin/env bash
# e2e: kvserve router placement policies over four real stories260K workers (issue 9
# acceptance: stickiness, content placement, burst, health, refusals, coordinator; policies).
if [ $# -eq 0 ]; then set -- policies sticky content burst coordinator refuse hashes replicas health; fi
exec bash "$(dirname "$0")/run_python_e2e.sh" routing.py "$@"
