#!/usr/bin/env bash
# ctest fixture e2e_npm_install (FIXTURES_SETUP node_modules): installs tests/e2e's JavaScript
# peers (package.json / package-lock.json) once, before every test that needs them, so no two
# tests run `npm install` in the same folder at once. Nothing to do when they are present.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/lib.sh"
have() { [[ -d "$here/node_modules/openai" && -d "$here/node_modules/@anush008/tokenizers" && -d "$here/node_modules/@huggingface/jinja" ]]; }
if have; then echo "node modules present"; exit 0; fi
need_cmd node npm
(cd "$here" && npm install --no-audit --no-fund --loglevel=error >/dev/null) || missing_dep "npm install failed"
have || missing_dep "npm install left modules missing"
echo "node modules installed"
