import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")
    config.addinivalue_line("markers", "multiprocess: launches real processes with torchrun on gloo")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def run_workers(script: str, *args: str, nproc: int = 2, timeout: int = 600) -> str:
    """Run a worker under torchrun (or alone when nproc is 0) and return its output; fail with it."""
    launcher = [sys.executable] if nproc == 0 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"
    ]
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [*launcher, os.path.join(ROOT, "tests", "distributed", script), *args],
        capture_output=True, text=True, timeout=timeout, env=env,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{script} {' '.join(args)} failed:\n{output[-6000:]}"
    return output


@pytest.fixture(scope="session")
def single_process():
    """A one-process gloo group with megatron-core's parallel state (TP = PP = DP = 1)."""
    import socket

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from angpt import distributed

    if not dist.is_initialized():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        # On a GPU machine, CUDA tensors go through NCCL (gloo lacks reduce-scatter for them).
        backend = "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
            backend = "cpu:gloo,cuda:nccl"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    distributed.initialize()
    yield
    parallel_state.destroy_model_parallel()


@pytest.fixture
def seeded(single_process):
    from angpt.distributed import set_random_seed

    set_random_seed(1234)
