#!/usr/bin/env bash
# e2e: OpenAI/vLLM API parity (n > 1, logit_bias, stop_token_ids, min_tokens, priority, chat
# details, served names, --api-key, CORS, vllm:* metrics, the SIGTERM drain): api_parity.py.
here="$(cd "$(dirname "$0")" && pwd)"
: "${KVSERVE_TEST_DATA:=$here/../../../shared/data}"
export KVSERVE_TEST_DATA
if [ ! -f "$KVSERVE_TEST_DATA/models/stories260K/stories260K.gguf" ]; then
    echo "SKIP: test data not found in $KVSERVE_TEST_DATA (set KVSERVE_TEST_DATA)"
    exit 77
fi
exec bash "$here/run_python_e2e.sh" api_parity.py "$@"
