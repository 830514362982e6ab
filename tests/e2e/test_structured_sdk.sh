#!/usr/bin/env bash
# Structured output and tool calls (issue 12) through the official OpenAI Node SDK (structured_sdk.mjs).
exec bash "$(cd "$(dirname "$0")" && pwd)/test_openai_sdk.sh" structured_sdk.mjs
