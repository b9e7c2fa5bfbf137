'use strict';
// A real tandem-gpu-worker for the SDK tests: started on a free loopback port (it prints
// "LISTENING <port>" once it serves), killed by stop(). Its logs (stderr) go to the test output.

const { spawn } = require('node:child_process');

// Resolves to { address, stop } once the worker serves; rejects when it exits first or stays
// silent past timeoutMs.
function startWorker(binary, modelDir, { extraFlags = [], timeoutMs = 60_000 } = {}) {
  const argv = [`--model=${modelDir}`, '--address=127.0.0.1:0', '--backend=cpu',
    '--cpu_threads=2', '--embedded_pool_bytes=64MiB', '--mode=gpu', '--log_level=warn',
    ...extraFlags];
  // Passive OpenMP threads: the worker shares the CI's cores with the test (README).
  const child = spawn(binary, argv, {
    stdio: ['ignore', 'pipe', 'inherit'],
    env: { ...process.env, OMP_WAIT_POLICY: 'passive' },
  });
  const stop = () => { if (child.exitCode === null && child.signalCode === null) child.kill('SIGKILL'); };
  process.on('exit', stop);   // no worker outlives a test file that failed or bailed out
  return new Promise((resolve, reject) => {
    let out = '';
    const timer = setTimeout(() => { stop(); reject(new Error(`${binary}: no LISTENING after ${timeoutMs} ms`)); },
      timeoutMs);
    child.on('error', (err) => { clearTimeout(timer); reject(err); });
    child.on('exit', (code, signal) => {
      clearTimeout(timer);
      reject(new Error(`${binary} exited (${code ?? signal}) before serving; stdout: ${out}`));
    });
    child.stdout.on('data', (chunk) => {
      out += chunk;
      const m = /^LISTENING (\d+)$/m.exec(out);
      if (m) {
        clearTimeout(timer);
        child.stdout.resume();   // keep draining it
        resolve({ address: `127.0.0.1:${m[1]}`, stop, child });
      }
    });
  });
}

module.exports = { startWorker };
