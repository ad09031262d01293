// Builds tracker.js into a component: node build.mjs OUT.wasm
//
// Assembles the WIT in build/wit (world.wit, hearth's package from ../../../wit,
// and the WASI 0.2.12 packages jco ships), then runs componentize-js with the
// http and fetch-event features off: the tracker calls wasi:http itself
// (world.wit imports it), synchronously, rather than through fetch().
import { componentize } from '@bytecodealliance/componentize-js';
import { cp, mkdir, rm, writeFile } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const here = dirname(fileURLToPath(import.meta.url));
const out = process.argv[2] ?? join(here, 'build', 'js-tracker.wasm');
const wit = join(here, 'build', 'wit');
const wasi = join(here, 'node_modules', '@bytecodealliance', 'jco', 'lib', 'wit', 'builtin', '0.2.12');

await rm(wit, { recursive: true, force: true });
await mkdir(join(wit, 'deps'), { recursive: true });
await cp(join(here, 'world.wit'), join(wit, 'world.wit'));
await cp(join(here, '..', '..', '..', 'wit'), join(wit, 'deps', 'hearth-plugin'), { recursive: true });
for (const pkg of ['wasi-filesystem', 'wasi-io', 'wasi-clocks', 'wasi-http', 'wasi-random', 'wasi-cli', 'wasi-sockets']) {
  await cp(join(wasi, pkg), join(wit, 'deps', pkg), { recursive: true });
}
const { component } = await componentize({
  sourcePath: join(here, 'tracker.js'),
  witPath: wit,
  worldName: 'js-tracker',
  disableFeatures: ['http', 'fetch-event'],
});
await mkdir(dirname(out), { recursive: true });
await writeFile(out, component);
console.log(`wrote ${out} (${component.length} bytes)`);
