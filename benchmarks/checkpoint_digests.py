#!/usr/bin/env python
"""What checkpoint digests cost: hashing throughput against the time a load takes, on a real checkpoint.

    python benchmarks/checkpoint_digests.py [--hidden-size 1024 --num-layers 4 --vocab-size 32768] [--dir DIR]

Trains one step of a model in one process (gloo), saves it (the commit records the digests), then times,
on the checkpoint's files: xxh3_128 as `angpt.training.digests` streams them, hashlib's blake2b and sha256 for
comparison, `digests.record` (what a commit adds), `verify_checkpoint` (what a resume adds) and
`load_checkpoint` (model, optimizer, RNG). The defaults (118M parameters, fp32 with Adam's moments) write
about 1.5 GB; the files are read from the page cache, as right after a save (a cold read from disk adds
the same I/O to hashing and to loading).
"""

import argparse
import hashlib
import os
import shutil
import tempfile
import time

from angpt.config.arguments import parse_args
from angpt.training import checkpointing, digests
from angpt.training.trainer import Trainer


def options():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=32768)
    parser.add_argument("--dir", help="where to write the checkpoint (default: a temporary directory, removed)")
    return parser.parse_args()


def hashlib_digest(name: str, path: str) -> str:
    hasher = hashlib.new(name)
    with open(path, "rb", buffering=0) as file:
        while chunk := file.read(digests.CHUNK):
            hasher.update(chunk)
    return hasher.hexdigest()


def timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def main():
    opts = options()
    root = opts.dir or tempfile.mkdtemp(prefix="checkpoint_digests_")
    flags = ["--num-layers", str(opts.num_layers), "--hidden-size", str(opts.hidden_size), "--num-attention-heads",
             str(opts.hidden_size // 64), "--seq-length", "128", "--micro-batch-size", "1", "--global-batch-size", "1",
             "--lr", "1e-4", "--mock-data", "--vocab-size", str(opts.vocab_size), "--eval-iters", "0",
             "--log-interval", "1", "--train-iters", "1"]
    try:
        trainer = Trainer(parse_args([*flags, "--save", root], world_size=1))
        save_seconds = timed(trainer.run)
        path = checkpointing.checkpoint_dir(root, 1)
        files = [os.path.join(parent, name) for parent, _, names in os.walk(path) for name in names]
        size = sum(os.path.getsize(file) for file in files) / 2**20
        print(f"checkpoint {path}: {len(files)} files, {size:.0f} MiB (run with its save: {save_seconds:.1f} s)")
        for name, digest in [("xxh3_128 (angpt.training.digests)", digests.file_digest),
                             ("blake2b", lambda file: hashlib_digest("blake2b", file)),
                             ("sha256", lambda file: hashlib_digest("sha256", file))]:
            seconds = timed(lambda: [digest(file) for file in files])
            print(f"{name:>26}: {size / seconds:8.0f} MiB/s ({seconds:.2f} s)")
        record = timed(lambda: digests.record(path))
        verify = timed(lambda: checkpointing.verify_checkpoint(path))
        load = timed(lambda: checkpointing.load_checkpoint(path, trainer.chunks, trainer.optimizer,
                                                             trainer.scheduler))
        print(f"digests.record {record:.2f} s, verify_checkpoint {verify:.2f} s, load_checkpoint {load:.2f} s: "
              f"verifying adds {100 * verify / load:.0f}% to a resume's load")
    finally:
        if not opts.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
