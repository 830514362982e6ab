#!/usr/bin/python3
"""Stands in for `llama-server` when llama.cpp's server test suite runs against kvserve
(run_llamacpp_server_tests.sh): translates the llama-server options the suite passes into
`kvserve serve` options and execs it. What cannot be translated is reported on stderr:

  --hf-repo/--hf-file  only tinyllamas/stories260K.gguf exists offline (the test data's copy);
                       any other model makes the shim exit 1 (the test then fails to start)
  --ctx-size N --parallel P   --max-model-len N/P (llama.cpp's per-slot context)
  --alias A            --served-model-name A
  --api-key, --threads, --host, --port   as is; --allowed-origins '*' (llama-server's CORS)
  --temp, --seed, --n-predict, --chat-template, --batch-size, ...   no kvserve equivalent (a
                       request's own fields decide): ignored, with a note
env: KVSERVE_BIN (default build/kvserve), KVSERVE_TEST_DATA.
"""
import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
BIN = os.environ.get("KVSERVE_BIN", os.path.join(here, "../../build/kvserve"))
DATA = os.environ.get("KVSERVE_TEST_DATA", os.path.join(here, "../../../shared/data"))
MODELS = {"tinyllamas/stories260K.gguf": "models/stories260K/stories260K.gguf"}
WITH_VALUE = {"--host", "--port", "--temp", "--seed", "--model", "--model-url", "--model-draft",
              "--hf-repo", "--hf-file", "--batch-size", "--ubatch-size", "--threads", "--n-gpu-layers",
              "--draft", "--pooling", "--alias", "--ctx-size", "--parallel", "--n-predict",
              "--slot-save-path", "--grp-attn-n", "--grp-attn-w", "--lora", "--api-key", "--draft-max",
              "--draft-min", "--reasoning-format", "--chat-template", "--chat-template-file"}


def main(argv):
    opts, flags, i = {}, [], 0
    while i < len(argv):
        a = argv[i]
        if a in WITH_VALUE and i + 1 < len(argv):
            opts.setdefault(a, []).append(argv[i + 1])
            i += 2
        else:
            flags.append(a)
            i += 1
    one = lambda k, d=None: opts.get(k, [d])[-1]  # noqa: E731
    model = one("--model")
    hf = one("--hf-file")
    if not model and hf:
        if hf not in MODELS:
            print("shim: model %s/%s is not available offline" % (one("--hf-repo"), hf), file=sys.stderr)
            return 1
        model = os.path.join(DATA, MODELS[hf])
    if not model:
        print("shim: no model", file=sys.stderr)
        return 1
    args = [BIN, "serve", "--model", model, "--host", one("--host", "127.0.0.1"),
            "--port", one("--port", "8080"), "--log-level", "warn",
            "--allowed-origins", "*"]  # llama-server answers CORS for any origin
    if one("--alias"):
        args += ["--served-model-name", one("--alias")]
    ctx, par = one("--ctx-size"), one("--parallel")
    if ctx:
        args += ["--max-model-len", str(max(2, int(ctx) // int(par or 1)))]
    if one("--threads"):
        args += ["--threads", one("--threads")]
    for k in opts.get("--api-key", []):
        args += ["--api-key", k]
    ignored = [k for k in opts if k not in ("--model", "--hf-file", "--hf-repo", "--alias", "--ctx-size",
                                              "--parallel", "--threads", "--api-key", "--host", "--port")]
    if ignored or flags:
        print("shim: no kvserve equivalent, ignored: %s" % " ".join(ignored + flags), file=sys.stderr)
    os.execv(args[0], args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
