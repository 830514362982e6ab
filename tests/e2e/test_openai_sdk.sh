#!/usr/bin/env bash
# Acceptance 3: the official OpenAI Node SDK against a real kvserve worker on stories260K.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
model="${KVSERVE_TEST_DATA:-$here/../../../shared/data}/models/stories260K/stories260K.gguf"
source "$here/lib.sh"
[[ -f "$model" ]] || skip_test "$model not found (set KVSERVE_TEST_DATA)"
need_cmd node
need_node_module openai
# $1: the test script (default openai_sdk.mjs; test_openai_sdk_api.sh passes openai_sdk_api.mjs)
exec node "$here/${1:-openai_sdk.mjs}" "${KVSERVE_BIN:?}" "$model"
