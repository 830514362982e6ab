#!/usr/bin/env bash
# kvserve tokenize / detokenize: output formats agree, round trip, BOS handling, bad input fails.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
data="${KVSERVE_TEST_DATA:-$here/../../../shared/data}"
tok="$data/tokenizers/llama2"
if [[ ! -d "$tok" ]]; then echo "SKIP: $tok not found (set KVSERVE_TEST_DATA)"; exit 77; fi
bin=${KVSERVE_BIN:?}
fail() { echo "FAIL: $*"; exit 1; }
text=$'Hello world <s> caf\u00e9 \U0001F999\n  x'
ids=$(printf '%s' "$text" | "$bin" tokenize --tokenizer "$tok")
[[ ${ids%% *} == 1 ]] || fail "expected BOS first: $ids"
noboss=$(printf '%s' "$text" | "$bin" tokenize --tokenizer "$tok" --no-bos)
[[ "1 $noboss" == "$ids" ]] || fail "--no-bos: '$noboss' vs '$ids'"
json=$(printf '%s' "$text" | "$bin" tokenize --tokenizer "$tok" --json)
[[ $json == "{\"ids\":[${ids// /,}],\"tokens\":["* ]] || fail "--json: $json"
line=$(printf '%s\n' "$(node -e 'process.stdout.write(JSON.stringify(process.argv[1]))' "$text")" | "$bin" tokenize --tokenizer "$tok" --lines)
[[ $line == "[${ids// /,}]" ]] || fail "--lines: $line"
# <s> is plain text without --with-special and the BOS id with it
spec=$(printf '%s' "$text" | "$bin" tokenize --tokenizer "$tok" --with-special --no-bos)
[[ " $spec " == *" 1 "* && " $noboss " != *" 1 "* ]] || fail "--with-special: $spec / $noboss"
back=$(printf '%s' "$ids" | "$bin" detokenize --tokenizer "$tok" --skip-special)
[[ "$back" == "$text" ]] || fail "round trip: '$back'"
back2=$(printf '[%s]' "${ids// /, }" | "$bin" detokenize --tokenizer "$tok" --skip-special)
[[ "$back2" == "$text" ]] || fail "JSON array input: '$back2'"
for bad in '1 x 2' '99999999' '[1, 2' '-3'; do
  if printf '%s' "$bad" | "$bin" detokenize --tokenizer "$tok" >/dev/null 2>&1; then fail "accepted '$bad'"; fi
done
if printf 'x' | "$bin" tokenize --tokenizer /nonexistent >/dev/null 2>&1; then fail "accepted a missing tokenizer"; fi
if printf 'not json\n' | "$bin" tokenize --tokenizer "$tok" --lines >/dev/null 2>&1; then fail "accepted a non-JSON line"; fi
# a tokenizer with more tokens than the model's embedding rows: serve and generate both refuse it
hf="$data/models/stories260K/hf"
if [[ -d "$hf" ]]; then
  big=$(mktemp -d)
  trap 'rm -rf "$big"' EXIT
  cp "$hf"/* "$big"/
  node -e 'const f=process.argv[1], j=JSON.parse(require("fs").readFileSync(f));
    j.added_tokens.push({id: 600, content: "<extra>", special: true, single_word: false, lstrip: false, rstrip: false, normalized: false});
    require("fs").writeFileSync(f, JSON.stringify(j));' "$big/tokenizer.json"
  for cmd in "generate --prompt Once --max-tokens 2" "serve --port 0"; do
    set +e
    out=$(timeout 60 "$bin" $cmd --model "$big" 2>&1)
    rc=$?
    set -e
    [[ $rc -ne 0 && $rc -ne 124 && "$out" == *"embedding only 512 rows"* ]] || fail "$cmd with a 601-token tokenizer: rc $rc: ${out: -300}"
  done
else
  echo "SKIP part: $hf not found"
fi
echo "OK: tokenize/detokenize CLI"
