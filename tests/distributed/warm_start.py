"""A warm start for the tests' training processes: torchrun's job, minus importing torch and megatron-core in
every process (5-7 CPU-seconds each, most of a small test's cost).

    python tests/distributed/warm_start.py      (started by tests/launch.py, one per pytest worker)

It imports the third-party modules that angpt's modules import at their top (read from angpt/'s sources,
so the list cannot drift), and nothing of angpt: each rank imports angpt afresh, so that it reads its own
environment (ANGPT_KERNELS, the fault injection variables) as a cold start would. Then, for each request
(one JSON line on stdin: command, nproc, env, cwd, stdout and stderr paths, timeout), it forks nproc ranks
with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...), or one process
without it for nproc 0, and replies with one JSON line: each rank's exit code, and whether the timeout ended
them. As torchrun does, the first rank to fail ends the others. Each rank runs its command as `python
COMMAND` would (`-m module` or a script, as __main__) and exits through the interpreter's normal shutdown.

The server itself stays single-threaded in Python (numpy's OpenBLAS pool is fork-safe), so forking is safe.
"""

from __future__ import annotations

import ast
import gc
import importlib
import json
import os
import pathlib
import runpy
import signal
import sys
import time
import traceback
import warnings

torch = None  # imported by preload()
ROOT = pathlib.Path(__file__).resolve().parents[2]
# sys.path but this script's folder and the server's PYTHONPATH, which a rank's command and environment replace.
SERVER_PATH = [path for path in sys.path[1:] if path not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]


def third_party_imports() -> list[str]:
    """Every module that angpt's modules import at their top level, but angpt's own; sorted."""
    names = set()
    for path in (ROOT / "angpt").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
    return sorted(name for name in names if name.split(".")[0] not in ("angpt", "__future__"))


def preload() -> None:
    global torch
    import torch  # noqa: PLC0415 (preloaded with the rest, to set the ranks' threads)

    with warnings.catch_warnings():  # import-time warnings belong to the ranks' own imports, not here
        warnings.simplefilter("ignore")
        for name in third_party_imports():
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - optional dependencies (Transformer Engine, say): the rank decides
                pass


def rank_environment(env: dict, nproc: int, rank: int, port: int) -> dict:
    if nproc == 0:
        return env
    # torchrun's defaults: one thread per rank unless told otherwise.
    return {"OMP_NUM_THREADS": "1", **env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(nproc),
            "ROLE_NAME": "default", "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "warm",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")}


def wait_for(pids: list[int], timeout: float) -> tuple[list[int], bool]:
    """Each process's exit code (negative: the signal that ended it); on the first failure, or at the timeout,
    the others are killed."""
    codes = {pid: None for pid in pids}
    deadline, timed_out = time.monotonic() + timeout, False
    while any(code is None for code in codes.values()):
        for pid in [pid for pid, code in codes.items() if code is None]:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
        failed = any(code not in (None, 0) for code in codes.values())
        timed_out = timed_out or time.monotonic() > deadline
        if failed or timed_out:
            for pid, code in codes.items():
                if code is None:
                    os.kill(pid, signal.SIGKILL)
                    codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        time.sleep(0.02)
    return [codes[pid] for pid in pids], timed_out


def serve() -> tuple[dict, int] | None:
    """Answer requests until stdin closes (None); in a forked rank, return (its request, its rank)."""
    requests, replies = sys.stdin.buffer, sys.stdout
    for line in requests:
        request = json.loads(line)
        nproc, port = request["nproc"], request["port"]
        pids = []
        for rank in range(max(nproc, 1)):
            pid = os.fork()
            if pid == 0:
                request["env"] = rank_environment(request["env"], nproc, rank, port)
                return request, rank
            pids.append(pid)
        codes, timed_out = wait_for(pids, request["timeout"])
        replies.write(json.dumps({"returncodes": codes, "timed_out": timed_out}) + "\n")
        replies.flush()
    return None


def become(request: dict) -> None:
    """Turn this forked process into `python COMMAND` with the request's environment, directory and output."""
    os.setpgid(0, 0)  # as its own group: a signal to the server's group does not reach a rank mid-test
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
        signal.signal(number, signal.SIG_DFL if number != signal.SIGINT else signal.default_int_handler)
    os.environ.clear()
    os.environ.update(request["env"])
    # torch read OMP_NUM_THREADS when the server imported it; a cold start reads the rank's own (no pool
    # exists yet, so setting it here is what a cold start does).
    threads = request["env"].get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else os.cpu_count() or 1)
    os.chdir(request["cwd"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(out, fd)
        os.close(out)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    warnings.resetwarnings()
    for option in filter(None, request["env"].get("PYTHONWARNINGS", "").split(",")):
        warnings._setoption(option)  # what the interpreter does with PYTHONWARNINGS at a cold start
    # As a cold start's: the command's folder (run() puts it first), PYTHONPATH, then the interpreter's own.
    extra = [path for path in request["env"].get("PYTHONPATH", "").split(os.pathsep) if path]
    sys.path[:] = [*extra, *SERVER_PATH]


def run(command: list[str]) -> int:
    """`python COMMAND`'s exit code: `-m module args...` or `script args...`."""
    try:
        if command[0] == "-m":
            sys.argv = [command[1], *command[2:]]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(command[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(command)
            sys.path.insert(0, os.path.dirname(os.path.abspath(command[0])))
            runpy.run_path(command[0], run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught exception
        traceback.print_exc()
        return 1
    return 0


def main() -> None:
    preload()
    # The imports' half a million objects out of the ranks' collections: a full one took 0.2-0.4 s, and the
    # equivalence job's 63 rebuilds of megatron-core's groups (each collects, angpt.training.distributed) spent
    # 45% of its time there. The ranks' own objects are collected as in a cold start.
    gc.freeze()
    served = serve()
    if served is None:
        return
    request, _ = served
    become(request)
    code = run(request["command"])
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


if __name__ == "__main__":
    main()
