"""A real tandem-gpu-worker for the SDK tests: started on a free loopback port, stopped at exit.

The worker prints "LISTENING <port>" on stdout once it serves (--address=127.0.0.1:0 picks the
port); its logs (stderr) go to the test's output.
"""

import ctypes
import os
import select
import signal
import subprocess
import time
from typing import List, Optional

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # In the child before exec: SIGKILL it when the test process dies (a ctest timeout kills
    # only the test), so no worker outlives its suite.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class WorkerProcess:
    def __init__(self, binary: str, model_dir: str, extra_flags: Optional[List[str]] = None):
        self.binary = binary
        self.model_dir = model_dir
        self.extra_flags = list(extra_flags or [])
        self.process: Optional[subprocess.Popen] = None
        self.port: Optional[int] = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> None:
        """Starts the worker (cpu backend, gpu mode: exact greedy) and waits for its port.
        Raises RuntimeError when it exits or stays silent past timeout_s."""
        argv = [self.binary, f"--model={self.model_dir}", "--address=127.0.0.1:0", "--backend=cpu",
                "--cpu_threads=2", "--embedded_pool_bytes=64MiB", "--mode=gpu",
                "--log_level=warn"] + self.extra_flags
        # Passive OpenMP threads: the worker shares the CI's cores with the test (README).
        env = dict(os.environ, OMP_WAIT_POLICY="passive")
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, env=env,
                                        preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout_s
        buffer = b""
        fd = self.process.stdout.fileno()
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                buffer += chunk
                for line in buffer.decode(errors="replace").splitlines():
                    if line.startswith("LISTENING "):
                        self.port = int(line.split()[1])
                        return
            if self.process.poll() is not None:
                break
        self.stop()
        raise RuntimeError(f"{self.binary} did not report LISTENING (stdout: {buffer!r})")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if self.process is not None and self.process.stdout is not None:
            self.process.stdout.close()
        self.process = None
