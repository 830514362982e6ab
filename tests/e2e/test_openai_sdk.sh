#!/usr/bin/env bash
# Acceptance 3: the official OpenAI Node SDK against a real kvserve worker on stories260K.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
model="${KVSERVE_TEST_DATA:-$here/../../../shared/data}/models/stories260K/stories260K.gguf"
if [[ ! -f "$model" ]]; then echo "SKIP: $model not found (set KVSERVE_TEST_DATA)"; exit 77; fi
if ! command -v node >/dev/null; then echo "SKIP: node not installed"; exit 77; fi
if [[ ! -d "$here/node_modules/openai" ]]; then
  (cd "$here" && npm install --no-audit --no-fund --loglevel=error >/dev/null)
fi
# $1: the test script (default openai_sdk.mjs; test_openai_sdk_api.sh passes openai_sdk_api.mjs)
exec node "$here/${1:-openai_sdk.mjs}" "${KVSERVE_BIN:-$here/../../build/kvserve}" "$model"
