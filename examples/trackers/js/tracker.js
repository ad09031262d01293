// A hearth tracker in JavaScript: one JSON line per logged step in
// /logs/steps.jsonl. Built into a WebAssembly component by componentize-js
// (see build.mjs and docs/src/plugins.md).
import { log as hostLog } from 'hearth:plugin/log@0.3.0';
import { getDirectories } from 'wasi:filesystem/preopens@0.2.12';

const encoder = new TextEncoder();
let file = null;
let out = null;

// u64/s64 arrive as BigInt, which JSON.stringify refuses.
const plain = (v) => (typeof v === 'bigint' ? Number(v) : v);

// result<_, string>: return for ok, throw a *string* for err. Anything else
// thrown traps the instance (hearth then starts a fresh one), so turn it
// into a string.
const guarded = (f) => (...args) => {
  try {
    return f(...args);
  } catch (e) {
    throw typeof e === 'string' ? e : String(e?.payload ?? e);
  }
};

export const tracker = {
  start: guarded((run, config, options, restart) => {
    const logs = getDirectories().find(([, path]) => path === '/logs');
    if (!logs) throw 'no /logs folder was granted';
    file = logs[0].openAt({}, 'steps.jsonl', { create: true }, { write: true });
    out = file.appendViaStream();
    hostLog('info', `js tracker: ${run.project}/${run.run}, ${config.length} config values`);
  }),
  log: guarded((step, values) => {
    if (!out) throw 'log before start';
    const row = { step: plain(step) };
    // Each value is { tag: 'float' | 'int' | 'boolean' | 'text', val }.
    for (const [name, value] of values) row[name] = plain(value.val);
    const bytes = encoder.encode(JSON.stringify(row) + '\n');
    for (let i = 0; i < bytes.length; i += 4096) out.blockingWriteAndFlush(bytes.subarray(i, i + 4096));
  }),
  finish: guarded(() => {
    out?.[Symbol.dispose]();
    file?.[Symbol.dispose]();
    out = file = null;
  }),
};
