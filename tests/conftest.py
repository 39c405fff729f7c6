import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PYDOC_VOCAB_SIZE = 512  # the BPE of the pydoc_corpus fixture


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


@pytest.fixture(scope="session")
def pydoc_corpus(tmp_path_factory):
    """Python's own help texts (pydoc_data.topics, one document per topic, every tenth topic for validation),
    prepared offline with the project's tools as examples/quickstart.sh prepares its corpus: train.jsonl and
    valid.jsonl, a byte-level BPE of PYDOC_VOCAB_SIZE tokens trained on train.jsonl (tokenizer/), and the
    indexed datasets train_text_document and valid_text_document. The directory is a `--corpus` of
    benchmarks/convergence.py."""
    from pydoc_data.topics import topics

    root = tmp_path_factory.mktemp("pydoc_corpus")
    keys = sorted(topics)
    splits = {"train": [key for i, key in enumerate(keys) if i % 10], "valid": keys[::10]}
    for split, names in splits.items():
        with open(root / f"{split}.jsonl", "w") as handle:
            for key in names:
                handle.write(json.dumps({"text": topics[key]}) + "\n")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}

    def start(*command: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, *command], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)

    def finish(process: subprocess.Popen) -> None:
        stdout, stderr = process.communicate()
        assert process.returncode == 0, f"{' '.join(process.args[1:])} failed:\n{stdout[-2000:]}{stderr[-4000:]}"

    finish(start("tools/train_tokenizer.py", "--input", str(root / "train.jsonl"),
                 "--vocab-size", str(PYDOC_VOCAB_SIZE), "--output-dir", str(root / "tokenizer")))
    # Both splits side by side: each process spends most of its time importing megatron-core.
    for process in [start("tools/preprocess_data.py", "--input", str(root / f"{split}.jsonl"),
                          "--output-prefix", str(root / split), "--tokenizer-type", "HuggingFaceTokenizer",
                          "--tokenizer-model", str(root / "tokenizer"), "--append-eod")
                    for split in splits]:
        finish(process)
    return root
