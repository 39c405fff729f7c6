#!/usr/bin/env python
"""The wheels the GPU machine lacks, into .whl/, for benchmarks/gpu_checks.sh (which installs them there).

    python tools/gpu_wheels.py [--output .whl] [--python-version 3.12] [--limit-mib 64] [--te]
    (make gpu-wheels; make gpu-wheels TE=1)

The GPU machine (docs/gpu.md) has no package registry; its image brings torch, transformers, tokenizers,
tiktoken, sentencepiece, pyarrow, TensorBoard and the rest of angpt's dependencies, but not megatron-core,
gigatoken (and awkward, which it imports) or nltk (and defusedxml). Each is downloaded for that machine's
Python as a binary wheel (pip download --only-binary, the manylinux platforms), at the version installed here,
where the tests ran: the same code on both machines. The total is checked against what one call of the device
tool carries (64 MiB, the checkout's tracked files included): over it, the command fails in one line naming the
largest files.

--te prepares `gpu_checks.sh --te` too: Transformer Engine's bundle for sm_90 (tools/te_bundle.py prepare, about
30 MiB; kept if .whl/ has one) and the corpus its FP8 benchmark trains on, data/shakespeare (the quickstart's
data steps, DATA_ONLY=1), both counted in the total.
"""

import argparse
import glob
import importlib.metadata
import os
import subprocess
import sys
from typing import Optional

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
CORPUS = "data/shakespeare"  # what benchmarks/gpu_checks.sh --te trains FP8 on

# What the GPU image lacks of angpt's dependencies and theirs (checked against its package list).
MISSING = ("megatron-core", "gigatoken", "awkward", "awkward-cpp", "nltk", "defusedxml")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=".whl", help="the folder gpu_checks.sh installs from (default .whl)")
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default 3.12)")
    parser.add_argument("--limit-mib", type=float, default=64, help="what one device call carries (default 64)")
    parser.add_argument("--te", action="store_true",
                        help=f"also Transformer Engine's bundle and {CORPUS}, for gpu_checks.sh --te")
    return parser.parse_args(argv)


def pinned(name: str) -> str:
    try:
        return f"{name}=={importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        sys.exit(f"gpu_wheels.py: {name} is not installed here (make setup): its version is the one tested")


def carried(folder: str) -> dict:
    """{path: bytes} of what gpu_checks.sh uses from `folder`: its wheels and Transformer Engine bundles, or
    every file of a corpus folder."""
    if os.path.basename(os.path.normpath(folder)) == os.path.basename(CORPUS):
        paths = [path for path in glob.glob(os.path.join(folder, "**"), recursive=True) if os.path.isfile(path)]
    else:
        paths = glob.glob(os.path.join(folder, "*.whl")) + glob.glob(os.path.join(folder, "te-*.tar.xz"))
    return {path: os.path.getsize(path) for path in sorted(paths)}


def checkout_bytes() -> int:
    """The bytes of the checkout's tracked files, which every device call carries with .whl/."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return sum(os.path.getsize(os.path.join(ROOT, name)) for name in listed.decode().split("\0")
               if name and os.path.isfile(os.path.join(ROOT, name)))


def check_total(folders: list, limit_mib: float, also: Optional[dict] = None) -> tuple:
    """(the bytes carried from `folders` and `also` ({what: bytes}), each printed; an error naming the largest
    if over `limit_mib`)."""
    sizes = {path: size for folder in folders for path, size in carried(folder).items()}
    sizes.update(also or {})
    for path, size in sizes.items():
        print(f"{size / 2**20:8.2f} MiB  {path}")
    total = sum(sizes.values())
    if total <= limit_mib * 2**20:
        return total, None
    largest = sorted(sizes, key=sizes.get, reverse=True)[:4]
    return total, (f"{' and '.join(folders)} hold {total / 2**20:.1f} MiB, over the {limit_mib:g} MiB a device "
                   f"call carries: remove what the GPU machine does not need (the largest: {', '.join(largest)})")


def prepare_transformer_engine(output: str, python_version: str) -> None:
    if glob.glob(os.path.join(output, "te-*.tar.xz")):
        print(f"Transformer Engine's bundle: already in {output}/ (kept)", file=sys.stderr)
        return
    bundle = os.path.join(output, f"te-sm90-cp{python_version.replace('.', '')}.tar.xz")
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "te_bundle.py"), "prepare", "--arch", "90",
                    "--python", python_version, "--output", bundle], check=True)


def prepare_corpus() -> None:
    env = {**os.environ, "DATA_ONLY": "1", "CORPUS_DIR": CORPUS,
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    subprocess.run(["bash", os.path.join(ROOT, "examples", "quickstart.sh")], cwd=ROOT, env=env, check=True)


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
    folders = [args.output]
    if args.te:
        try:
            prepare_transformer_engine(args.output, args.python_version)
            prepare_corpus()
        except subprocess.CalledProcessError as error:
            print(f"gpu_wheels.py: --te: {' '.join(map(str, error.cmd[:3]))} failed (exit {error.returncode})",
                  file=sys.stderr)
            return 1
        folders.append(os.path.join(ROOT, CORPUS))
    total, error = check_total(folders, args.limit_mib, {"the checkout's tracked files": checkout_bytes()})
    print(f"{total / 2**20:8.2f} MiB  in all, of {args.limit_mib:g} MiB a device call carries")
    if error:
        print(f"gpu_wheels.py: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
