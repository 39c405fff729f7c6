#!/usr/bin/env python
"""The wheels the GPU machine lacks, into .whl/, for benchmarks/gpu_checks.sh (which installs them there).

    python tools/gpu_wheels.py [--output .whl] [--python-version 3.12] [--limit-mib 64]     (make gpu-wheels)

The GPU machine (docs/gpu.md) has no package registry; its image brings torch, transformers, tokenizers,
tiktoken, sentencepiece, pyarrow, TensorBoard and the rest of angpt's dependencies, but not megatron-core,
gigatoken (and awkward, which it imports) or nltk (and defusedxml). Each is downloaded for that machine's
Python as a binary wheel (pip download --only-binary, the manylinux platforms), at the version installed here,
where the tests ran: the same code on both machines. The total is checked against what one call of the device
tool carries (64 MiB, the working tree included): over it, the command fails in one line naming the wheels.
"""

import argparse
import importlib.metadata
import os
import subprocess
import sys

# What the GPU image lacks of angpt's dependencies and theirs (checked against its package list).
MISSING = ("megatron-core", "gigatoken", "awkward", "awkward-cpp", "nltk", "defusedxml")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=".whl", help="the folder gpu_checks.sh installs from (default .whl)")
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default 3.12)")
    parser.add_argument("--limit-mib", type=float, default=64, help="what one device call carries (default 64)")
    return parser.parse_args(argv)


def pinned(name: str) -> str:
    try:
        return f"{name}=={importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        sys.exit(f"gpu_wheels.py: {name} is not installed here (make setup): its version is the one tested")


def check_total(folder: str, limit_mib: float) -> tuple:
    """(the bytes of the wheels in `folder`, printed one a line; an error naming them if over `limit_mib`)."""
    wheels = sorted(name for name in os.listdir(folder) if name.endswith(".whl"))
    sizes = {name: os.path.getsize(os.path.join(folder, name)) for name in wheels}
    for name in wheels:
        print(f"{sizes[name] / 2**20:8.2f} MiB  {name}")
    total = sum(sizes.values())
    if total <= limit_mib * 2**20:
        return total, None
    return total, (f"{folder}/ holds {total / 2**20:.1f} MiB of wheels, over the {limit_mib:g} MiB a device call "
                   f"carries: remove what the GPU machine does not need ({', '.join(wheels)})")


def main(argv=None) -> int:
    args = parse_args(argv)
    requirements = [pinned(name) for name in MISSING]
    os.makedirs(args.output, exist_ok=True)
    platforms = [flag for platform in PLATFORMS for flag in ("--platform", platform)]
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", args.python_version, "--implementation", "cp", *platforms, "-d", args.output,
               *requirements]
    print(f"downloading {', '.join(requirements)} for Python {args.python_version} into {args.output}/",
          file=sys.stderr)
    if subprocess.run(command).returncode != 0:
        print(f"gpu_wheels.py: pip download failed for {' '.join(requirements)}", file=sys.stderr)
        return 1
    total, error = check_total(args.output, args.limit_mib)
    print(f"{total / 2**20:8.2f} MiB  in all, of {args.limit_mib:g} MiB a device call carries")
    if error:
        print(f"gpu_wheels.py: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
