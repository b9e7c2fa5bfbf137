'use strict';
// ctest entry of the Node SDK's tests: checks what they need and runs them, or exits 77 (ctest:
// skipped) with a message.
//   node run.js e2e     node --test client.test.js against a real tandem-gpu-worker
//   node run.js types   tsc -p clients/node: the README example against index.d.ts
// Environment: TANDEM_GPU_WORKER_BIN, TANDEM_SHARED_DIR (set by tests/clients/CMakeLists.txt).

const { spawnSync } = require('node:child_process');
const fs = require('node:fs');
const path = require('node:path');

const SKIP_EXIT_CODE = 77;
const SDK_DIR = path.resolve(__dirname, '..', '..', '..', 'clients', 'node');

function skip(reason) {
  console.log(`SKIPPED: ${reason}`);
  process.exit(SKIP_EXIT_CODE);
}

function run(argv, cwd) {
  const r = spawnSync(process.execPath, argv, { cwd, stdio: 'inherit' });
  if (r.error) throw r.error;
  process.exit(r.status ?? 1);
}

const what = process.argv[2];
const needed = what === 'types' ? 'typescript' : '@grpc/grpc-js';
if (!fs.existsSync(path.join(SDK_DIR, 'node_modules', needed))) {
  skip(`${path.join(SDK_DIR, 'node_modules', needed)} is missing: run scripts/setup.sh ` +
    '(or `npm ci` in clients/node)');
}
if (what === 'types') {
  run([path.join(SDK_DIR, 'node_modules', 'typescript', 'bin', 'tsc'), '-p', SDK_DIR], SDK_DIR);
} else if (what === 'e2e') {
  const shared = process.env.TANDEM_SHARED_DIR || path.resolve(__dirname, '../../../../shared');
  const golden = path.join(shared, 'models', 'stories260k', 'golden.json');
  if (!fs.existsSync(golden)) skip(`no ${golden} (set TANDEM_SHARED_DIR)`);
  run(['--test', '--test-reporter=spec', path.join(__dirname, 'client.test.js')], __dirname);
} else {
  console.error('usage: node run.js e2e|types');
  process.exit(2);
}
