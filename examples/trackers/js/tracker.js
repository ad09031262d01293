// A hearth tracker in JavaScript: one JSON line per logged step in
// /logs/steps.jsonl and, with the option `url`, each step POSTed as JSON to
// that URL over wasi:http (a host the run config grants in
// [plugin-permissions.js-tracker] network). Built into a WebAssembly
// component by componentize-js (see build.mjs and docs/src/plugins.md).
import { log as hostLog } from 'hearth:plugin/log@0.3.0';
import { getDirectories } from 'wasi:filesystem/preopens@0.2.12';
import { handle } from 'wasi:http/outgoing-handler@0.2.12';
import { Fields, OutgoingBody, OutgoingRequest } from 'wasi:http/types@0.2.12';

const encoder = new TextEncoder();
let file = null;
let out = null;
let url = '';

// POSTs `doc` as JSON to `target` and returns the answer's status. hearth
// checks the request before it connects: a host not granted comes back as
// an error (thrown here), and nothing is sent.
function postJson(target, doc) {
  const [scheme, rest] = target.split('://');
  const slash = rest.indexOf('/');
  const data = encoder.encode(JSON.stringify(doc));
  const request = new OutgoingRequest(Fields.fromList([
    ['content-type', encoder.encode('application/json')],
    ['content-length', encoder.encode(String(data.length))],
  ]));
  request.setMethod({ tag: 'post' });
  request.setScheme({ tag: scheme === 'https' ? 'HTTPS' : 'HTTP' });
  request.setAuthority(slash < 0 ? rest : rest.slice(0, slash));
  request.setPathWithQuery(slash < 0 ? '/' : rest.slice(slash));
  const body = request.body();
  const future = handle(request, undefined);
  const stream = body.write();
  for (let i = 0; i < data.length; i += 4096) stream.blockingWriteAndFlush(data.subarray(i, i + 4096));
  stream[Symbol.dispose]();
  OutgoingBody.finish(body, undefined);
  const ready = future.subscribe();
  ready.block();
  ready[Symbol.dispose]();
  // option<result<result<incoming-response, error-code>>>, each result as
  // { tag: 'ok' | 'err', val }. A child resource goes before its parent
  // (the response, then the future).
  const answer = future.get();
  try {
    const got = answer?.tag === 'ok' ? answer.val : { tag: 'err', val: 'no answer' };
    if (got.tag === 'err') throw `POST ${target}: ${JSON.stringify(got.val)}`;
    const status = got.val.status();
    got.val[Symbol.dispose]();
    return status;
  } finally {
    future[Symbol.dispose]();
  }
}

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
    url = options.find(([key]) => key === 'url')?.[1]?.val ?? '';
    hostLog('info', `js tracker: ${run.project}/${run.run}, ${config.length} config values`);
  }),
  log: guarded((step, values) => {
    if (!out) throw 'log before start';
    const row = { step: plain(step) };
    // Each value is { tag: 'float' | 'int' | 'boolean' | 'text', val }.
    for (const [name, value] of values) row[name] = plain(value.val);
    const bytes = encoder.encode(JSON.stringify(row) + '\n');
    for (let i = 0; i < bytes.length; i += 4096) out.blockingWriteAndFlush(bytes.subarray(i, i + 4096));
    if (url) {
      // A server that is down or refuses costs a warning, not the tracker.
      try {
        const status = postJson(url, row);
        if (status >= 300) hostLog('warn', `POST ${url}: ${status}`);
      } catch (e) {
        hostLog('warn', `POST ${url}: ${typeof e === 'string' ? e : String(e?.payload ?? e)}`);
      }
    }
  }),
  finish: guarded(() => {
    out?.[Symbol.dispose]();
    file?.[Symbol.dispose]();
    out = file = null;
  }),
};
