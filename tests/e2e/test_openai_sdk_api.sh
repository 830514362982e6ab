#!/usr/bin/env bash
# The official OpenAI Node SDK against the API parity features (openai_sdk_api.mjs).
exec bash "$(cd "$(dirname "$0")" && pwd)/test_openai_sdk.sh" openai_sdk_api.mjs
