#!/usr/bin/env bash
# Differential test: kvserve's tokenizers against Hugging Face `tokenizers` (its Node binding)
# on 20,000 generated inputs per tokenizer (+ ~100 kB strings), encode with and without
# add_special_tokens and decode with and without skip_special_tokens. See tok_diff.mjs.
# TOK_DIFF_CASES / TOK_DIFF_SEED override the case count and the seed.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
data="${KVSERVE_TEST_DATA:-$here/../../../shared/data}"
source "$here/lib.sh"
[[ -d "$data/tokenizers/qwen3" ]] || skip_test "$data/tokenizers not found (set KVSERVE_TEST_DATA)"
need_cmd node
need_node_module @anush008/tokenizers
# HF single-threaded so the 2-core CI machine is shared fairly with the kvserve processes.
export RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
exec node "$here/tok_diff.mjs" "${KVSERVE_BIN:?}" "$data" --cases "${TOK_DIFF_CASES:-20000}" --seed "${TOK_DIFF_SEED:-1234}"
