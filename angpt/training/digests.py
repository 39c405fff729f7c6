"""Digests of a checkpoint's files, recorded when the checkpoint is committed and checked before it is read.

    iter_0000300/angpt_digests.json   {"algorithm": "xxh3_128",
                                       "files": {"__0_0.distcp": {"size": 337690, "digest": "9f0c..."}, ...}}

Every file of the directory is listed (the distributed checkpoint's shards and metadata, common.pt, the
tokenizer files) with its size and xxh3_128 digest. xxh3 is not a cryptographic hash: it catches what disks,
copies and interrupted transfers do, not someone who rewrites the digests too, and it hashes at memory
speed (benchmarks/checkpoint_digests.py measures it against the load).

Hashing is shared out among the ranks: each hashes a share of the files (balanced by size) and the results
are gathered, so a check costs about the size of the checkpoint divided by the world size, and every rank
reaches the same verdict (a rank alone refusing a collective load would leave the others hanging). A
distributed checkpoint is on a file system every rank reads, so any rank can hash any file.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch.distributed as dist
import xxhash

DIGESTS = "angpt_digests.json"
NOT_RECORDED = "no digests recorded"  # what `check` says of a directory without digests
ALGORITHM = "xxh3_128"
CHUNK = 16 << 20  # large reads: hashing runs at memory speed, a system call per chunk is negligible


def file_digest(path: str) -> str:
    hasher = xxhash.xxh3_128()
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as file:
        while count := file.readinto(buffer):
            hasher.update(view[:count])
    return hasher.hexdigest()


def _listing(directory: str) -> dict[str, int]:
    """{path relative to directory: size} of every file under it, but the digests themselves."""
    sizes = {}
    for parent, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(parent, name)
            relative = os.path.relpath(path, directory)
            if relative != DIGESTS:
                sizes[relative] = os.path.getsize(path)
    return sizes


def _my_share(sizes: dict[str, int]) -> list[str]:
    """This rank's files: the largest first, each to the least loaded rank (the same split on every rank)."""
    loads, mine = [0] * dist.get_world_size(), []
    for name in sorted(sizes, key=lambda name: (-sizes[name], name)):
        rank = loads.index(min(loads))
        loads[rank] += sizes[name]
        if rank == dist.get_rank():
            mine.append(name)
    return mine


def _gathered(part: dict) -> dict:
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, part)
    return {key: value for part in parts for key, value in part.items()}


def record(directory: str) -> None:
    """Collectively hash every file of `directory`; rank 0 writes the digests into it."""
    listing = [_listing(directory) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(listing, src=0)  # rank 0's view: it has just written the tokenizer files
    sizes = listing[0]
    digests = _gathered({name: file_digest(os.path.join(directory, name)) for name in _my_share(sizes)})
    if dist.get_rank() == 0:
        files = {name: {"size": sizes[name], "digest": digests[name]} for name in sorted(sizes)}
        with open(os.path.join(directory, DIGESTS), "w") as file:
            json.dump({"algorithm": ALGORITHM, "files": files}, file, indent=1)
            file.write("\n")
            file.flush()
            os.fsync(file.fileno())


def _read(directory: str) -> tuple[Optional[dict], Optional[str]]:
    """({name: (size, digest)}, None), or (None, NOT_RECORDED or why the digests cannot be read)."""
    path = os.path.join(directory, DIGESTS)
    if not os.path.isfile(path):
        return None, NOT_RECORDED
    try:
        with open(path) as file:
            content = json.load(file)
        if content["algorithm"] != ALGORITHM:
            return None, f"{path} uses the digest {content['algorithm']!r}, which this version does not know"
        return {name: (int(entry["size"]), str(entry["digest"])) for name, entry in content["files"].items()}, None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        return None, f"{path} is unreadable ({type(error).__name__}: {error})"


def _problem(directory: str, name: str, size: int, digest: str) -> Optional[str]:
    path = os.path.join(directory, name)
    try:
        actual = os.path.getsize(path)
        if actual != size:
            return f"{path} has {actual} bytes, {size} when it was saved (truncated or overwritten)"
        if file_digest(path) != digest:
            return f"{path} is corrupted (its content differs from the digest recorded when it was saved)"
    except FileNotFoundError:
        return f"{path} is missing"
    except OSError as error:  # a verdict all the same: the other ranks wait for this one's
        return f"{path} cannot be read ({error.strerror or error})"
    return None


def check(directory: str) -> Optional[str]:
    """Collectively check `directory` against its digests: None when every file is there as it was saved,
    NOT_RECORDED when it has no digests, else one line naming the first damaged file (and how many others
    are)."""
    read = [_read(directory) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(read, src=0)  # one reading, one verdict
    expected, unreadable = read[0]
    if unreadable:
        return unreadable
    sizes = {name: size for name, (size, _) in expected.items()}
    problems = _gathered({name: _problem(directory, name, *expected[name]) for name in _my_share(sizes)})
    damaged = sorted(name for name, problem in problems.items() if problem)
    if not damaged:
        return None
    others = f" (and {len(damaged) - 1} other damaged files)" if len(damaged) > 1 else ""
    return problems[damaged[0]] + others
