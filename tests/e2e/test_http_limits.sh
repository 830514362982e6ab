#!/usr/bin/env bash
# HTTP hardening: limits, framing checks, timeouts and JSON refusals of the connection gate
# (src/http/conn_gate.c) against real servers and a router. See http_limits.py.
exec bash "$(dirname "$0")/run_python_e2e.sh" http_limits.py "$@"
