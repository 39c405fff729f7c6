"""The export's directory: the output checked before anything is read, the export written into a sibling
directory and moved into place whole once complete (what was there goes, so that no stale file stays beside the
new export: an old model.safetensors would shadow new shards)."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from typing import Iterator

from angpt.hf.errors import ExportError


def checked_output(load: str, output: str, overwrite: bool) -> str:
    """`output` as an absolute path, refused when it is not a directory, holds the checkpoint `load`, or is not
    empty (unless `overwrite`)."""
    if os.path.exists(output) and not os.path.isdir(output):
        raise ExportError(f"{output} exists and is not a directory")
    output = os.path.abspath(output)
    if os.path.commonpath([output, os.path.abspath(load)]) == output:  # replacing it would delete the checkpoint
        raise ExportError(f"{output} holds the checkpoint {load}: export to another directory")
    if os.path.isdir(output) and os.listdir(output) and not overwrite:
        raise ExportError(f"{output} is not empty: give --overwrite to replace it with the new export")
    return output


def replace_directory(staging: str, output: str) -> None:
    """Put the finished `staging` where `output` is: what was there goes."""
    if not os.path.exists(output):
        os.rename(staging, output)
        return
    previous = staging + ".previous"
    os.rename(output, previous)
    os.rename(staging, output)
    shutil.rmtree(previous)


@contextmanager
def staged(output: str) -> Iterator[str]:
    """An empty sibling directory of `output` to write the export into; moved to `output` when the block
    completes, removed when it fails."""
    staging = os.path.join(os.path.dirname(output), f".{os.path.basename(output)}.incomplete-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    try:
        yield staging
        replace_directory(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
