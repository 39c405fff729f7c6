"""How the tests start training processes: `python COMMAND` or `torchrun --nproc-per-node N COMMAND`, cold
(a real interpreter and torchrun) or warm (forked by tests/distributed/warm_start.py after torch and
megatron-core are imported, once per pytest worker). Warm is for tests whose subject is the training, not
the launcher; tests of torchrun itself (signals to its group, restarts, two nodes) launch it for real.
Warm ranks import angpt afresh, so angpt's environment variables work as in a cold start; those that torch,
megatron-core or transformers read when imported (HF_HUB_OFFLINE, say) keep the server's values: a command
that depends on one is launched cold.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile

from angpt.training.distributed import free_port

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
WARM_START = os.path.join(ROOT, "tests", "distributed", "warm_start.py")


class WarmStarter:
    """The warm_start.py server of this process, started at the first request."""

    def __init__(self):
        self.server = None

    def _server(self) -> subprocess.Popen:
        if self.server is None or self.server.poll() is not None:
            env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore"}
            self.server = subprocess.Popen([sys.executable, WARM_START], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, cwd=ROOT, env=env)
            atexit.register(self.close)
        return self.server

    def run(self, command: list[str], nproc: int, env: dict, cwd: str, timeout: float
            ) -> subprocess.CompletedProcess:
        server = self._server()
        with tempfile.TemporaryDirectory(prefix="warm_start_") as out:
            paths = {name: os.path.join(out, name) for name in ("stdout", "stderr")}
            request = dict(command=command, nproc=nproc, env=env, cwd=cwd, timeout=timeout, port=free_port(), **paths)
            server.stdin.write((json.dumps(request) + "\n").encode())
            server.stdin.flush()
            # The server kills the ranks at the timeout; the margin is for its own reply.
            # poll, not select: a long session's pytest worker holds descriptors beyond select's 1024.
            poller = select.poll()
            poller.register(server.stdout, select.POLLIN)
            line = server.stdout.readline() if poller.poll((timeout + 60) * 1000) else b""
            if not line:
                self.close()
                raise RuntimeError(f"{WARM_START} did not answer (exit code {server.poll()})")
            reply = json.loads(line)
            stdout, stderr = (open(path).read() if os.path.exists(path) else "" for path in paths.values())
        launched = ["python", *command] if nproc == 0 else ["torchrun", f"--nproc-per-node={nproc}", *command]
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired(launched, timeout, stdout, stderr)
        codes = reply["returncodes"]
        # torchrun's exit code is 1 when a rank failed, whatever the rank's own.
        code = codes[0] if nproc == 0 else int(any(codes))
        return subprocess.CompletedProcess(launched, code, stdout, stderr)

    def close(self) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.stdin.close()
            self.server.wait()


warm = WarmStarter()


def launch(command: list[str], nproc: int = 0, env: dict | None = None, cwd: str = ROOT, timeout: float = 600,
           cold: bool = False) -> subprocess.CompletedProcess:
    """Run `python COMMAND` (nproc 0) or `torchrun --standalone --nproc-per-node NPROC COMMAND` to the end and
    return its exit code and output, warm unless `cold`. COMMAND is `-m module args...` or `script args...`."""
    env = dict(os.environ if env is None else env)
    if not cold:
        return warm.run(command, nproc, env, cwd, timeout)
    launcher = [sys.executable] if nproc == 0 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return subprocess.run([*launcher, *command], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
