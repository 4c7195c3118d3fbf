"""`holoserve serve` in a child process, run from any checkout (so two versions can be measured with one
command), and what a benchmark reads of it: readiness, CPU time, memory."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from .http import free_port


def rss_mb(pid: int) -> float:
    """A process's resident memory now (MB; 0 where it is gone)."""
    return memory_kb(pid).get("VmRSS", 0) / 1024


def memory_kb(pid: int) -> dict[str, int]:
    """VmRSS (resident now) and VmHWM (its peak) of a process, in kB ({} where it is gone)."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                out[k] = int(v.split()[0])
    except OSError:
        pass
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ServerProcess:
    """`python -m holoserve serve CKPT ARGS` from the checkout `root` on a free loopback port. Settings go in
    as HOLOSERVE_* variables in `env` or as flags in `args`; the caller's own HOLOSERVE_* variables are
    dropped so that only what the benchmark names is set. `nofile` caps the open files (0: unchanged)."""

    def __init__(self, root: Path, ckpt: Path, log: Path, args: list[str] = (), env: dict[str, str] | None = None,
                 threads: int = 1, nofile: int = 0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        full = {k: v for k, v in os.environ.items() if not k.startswith("HOLOSERVE_")}
        full.update({"OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
                     "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p),
                     "HOLOSERVE_PORT": str(self.port), "HOLOSERVE_HOST": "127.0.0.1", **(env or {})})

        def limit_files():
            if nofile:
                import resource

                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        with open(log, "ab") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "holoserve", "serve", str(ckpt), *args], env=full,
                                         cwd=root, stdout=subprocess.DEVNULL, stderr=err, preexec_fn=limit_files)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float = 120) -> bool:
        """True once /readyz answers 200; False if the process exits first; TimeoutError after `timeout` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=2) as r:
                    if r.status == 200:
                        return True
            except Exception:
                time.sleep(0.2)
        raise TimeoutError(f"the server did not become ready in {timeout:.0f} s; see {self.log}")

    def ready(self, timeout: float = 120) -> "ServerProcess":
        """This server once ready; raises (and kills it) where it exits or times out first."""
        try:
            if not self.wait_ready(timeout):
                raise RuntimeError(f"the server exited with {self.proc.returncode}; see {self.log}")
        except TimeoutError:
            self.proc.kill()
            self.proc.wait()
            raise
        return self

    def memory_kb(self) -> dict[str, int]:
        return memory_kb(self.proc.pid)

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        """SIGTERM (a graceful drain), then SIGKILL after 30 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
