// Shared by the OpenAI SDK tests (openai_sdk.mjs, openai_sdk_api.mjs): starts `kvserve serve` on
// a free port and counts named checks (TAP-style lines, then "N passed, M failed").
import { spawn } from 'node:child_process';
import { mkdtempSync, readFileSync, existsSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

// Resolves to { port, stop } once the server wrote its port file; extra: more serve options.
export async function startServer(bin, model, extra = []) {
  const portFile = join(mkdtempSync(join(tmpdir(), 'kvserve-sdk-')), 'port');
  const proc = spawn(bin, ['serve', '--model', model, '--port', '0', '--port-file', portFile,
    '--max-model-len', '512', '--log-level', 'warn', ...extra], { stdio: ['ignore', 'inherit', 'inherit'] });
  let exited = false;
  proc.on('exit', () => { exited = true; });
  const stop = () => { if (!exited) proc.kill('SIGTERM'); };
  for (let i = 0; i < 600; i++) {
    if (exited) throw new Error('server exited before listening');
    if (existsSync(portFile)) {
      const p = readFileSync(portFile, 'utf8').trim();
      if (p) return { port: Number(p), stop };
    }
    await new Promise((r) => setTimeout(r, 100));
  }
  stop();
  throw new Error('server did not start');
}

export function checker() {
  const c = { passed: 0, failures: 0 };
  c.check = async (name, fn) => {
    try { await fn(); c.passed++; console.log(`ok - ${name}`); }
    catch (e) { c.failures++; console.log(`not ok - ${name}: ${e.stack || e}`); }
  };
  c.fail = (what, e) => { c.failures++; console.log(`not ok - ${what}: ${e.stack || e}`); };
  c.finish = () => {
    console.log(`${c.passed} passed, ${c.failures} failed`);
    process.exit(c.failures ? 1 : 0);
  };
  return c;
}
