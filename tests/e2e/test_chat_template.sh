#!/usr/bin/env bash
# Differential test: `kvserve chat-template` vs @huggingface/jinja on the real chat templates in
# shared/data (Qwen3, Llama-3, DeepSeek-V3, Gemma-3, Llama-3.1) plus synthetic templates that
# cover the rest of the supported Jinja subset: >= 50 seeded conversations each, byte-identical
# renders (or both engines reject the conversation). Also checks the CLI's error contract.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
data="${KVSERVE_TEST_DATA:-$here/../../../shared/data}"
bin="${KVSERVE_BIN:?set KVSERVE_BIN}"
source "$here/lib.sh"
[[ -d "$data/tokenizers" ]] || skip_test "$data/tokenizers not found (set KVSERVE_TEST_DATA)"
need_cmd node
need_node_module @huggingface/jinja
node "$here/chat_template_diff.mjs" "$bin" "$data" 60

# errors: a clear message naming the construct and its position, exit status 1
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
printf 'ok\n{%% while x %%}{%% endwhile %%}' > "$tmp/bad.jinja"
if echo '[{"role":"user","content":"hi"}]' | "$bin" chat-template --template-file "$tmp/bad.jinja" 2>"$tmp/err"; then
  echo "FAIL: unsupported statement accepted"; exit 1
fi
grep -q "line 2, column 4: unsupported statement: while" "$tmp/err" || { echo "FAIL: error message: $(cat "$tmp/err")"; exit 1; }
if echo '[{"role":"user","content":"hi"},{"role":"user","content":"again"}]' |
   "$bin" chat-template --config "$data/chat-templates/gemma3.tokenizer_config.json" 2>"$tmp/err"; then
  echo "FAIL: gemma3 accepted non-alternating roles"; exit 1
fi
grep -q "raise_exception: Conversation roles must alternate" "$tmp/err" || { echo "FAIL: $(cat "$tmp/err")"; exit 1; }
# --no-generation-prompt on a template file, and a model without a template (ChatML built-in)
out=$(echo '[{"role":"user","content":"hi"}]' | "$bin" chat-template --tokenizer "$data/tokenizers/llama3" --no-generation-prompt)
[[ "$out" == $'<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>' ]] || { echo "FAIL: llama3 render: $out"; exit 1; }
echo "chat-template CLI error checks ok"
