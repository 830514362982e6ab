#!/usr/bin/env bash
# Installs the Debian 12 packages kvserve needs. Idempotent and non-interactive.
#   scripts/install-deps.sh          build + run dependencies
#   scripts/install-deps.sh --test   also what the tests need (cmocka, PyTorch reference,
#                                    clang + libFuzzer runtime, Node.js + npm peers)
set -euo pipefail
want=(build-essential cmake pkg-config gnuplot-nox librust-blake3-dev libevent-dev libjansson-dev libpcre2-dev libutf8proc-dev
      libopenblas-dev libcurl4-openssl-dev libucx-dev curl ca-certificates)
if [[ "${1:-}" == "--test" ]]; then
  want+=(libcmocka-dev python3 python3-numpy python3-torch nodejs npm jq iproute2 etcd-server
         clang libclang-rt-dev)
fi
missing=()
for p in "${want[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# nodejs/npm may come from outside Debian (e.g. a preinstalled Node): accept a working one.
if command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1; then
  tmp=(); for p in "${missing[@]}"; do [[ "$p" == nodejs || "$p" == npm ]] || tmp+=("$p"); done
  missing=("${tmp[@]+"${tmp[@]}"}")
fi
if ((${#missing[@]})); then
  echo "install-deps: installing ${missing[*]}"
  SUDO=""; [[ $(id -u) -eq 0 ]] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if [[ "${1:-}" == "--test" ]]; then
  # JavaScript peers (the official OpenAI SDK, HF tokenizers' binding) for the e2e tests.
  here=$(cd "$(dirname "$0")/.." && pwd)
  if [[ ! -d "$here/tests/e2e/node_modules/openai" || ! -d "$here/tests/e2e/node_modules/@anush008/tokenizers" || ! -d "$here/tests/e2e/node_modules/@huggingface/jinja" ]]; then
    (cd "$here/tests/e2e" && npm install --no-audit --no-fund --loglevel=error >/dev/null)
  fi
fi
