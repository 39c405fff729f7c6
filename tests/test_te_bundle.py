"""tools/te_bundle.py: the Transformer Engine bundle for an offline GPU node. The pruning is checked against what
nvcc itself builds for one architecture; the installer's checks on a small stand-in bundle."""

import base64
import csv
import ctypes
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import te_bundle  # noqa: E402

KERNEL = """
extern "C" __global__ void add_one(float* x) { x[threadIdx.x] += 1.0f; }
extern "C" int host_answer() { return 42; }
"""
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="needs nvcc")


def _library(directory: Path, name: str, *archs: str) -> bytes:
    """A shared library with `KERNEL`'s device code for each of `archs` (sm_XX), built by nvcc."""
    source = directory / "kernel.cu"
    source.write_text(KERNEL)
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    subprocess.run([NVCC, "-shared", "-Xcompiler", "-fPIC", *gencode, "-o", str(directory / name), str(source)],
                   check=True, capture_output=True, timeout=300)
    return (directory / name).read_bytes()


@pytest.fixture(scope="module")
def libraries(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fatbin")
    return directory, _library(directory, "multi.so", "80", "90", "90a"), _library(directory, "hopper.so", "90", "90a")


@pytest.mark.slow
@needs_nvcc
def test_keep_only_arch_leaves_what_nvcc_builds_for_that_arch_alone(libraries):
    directory, multi, hopper = libraries
    assert {entry.arch for entry in te_bundle.fatbin_entries(multi)} == {80, 90}
    pruned = bytearray(multi)
    counts = te_bundle.keep_only_arch(pruned, 90)

    # The code objects left are, byte for byte and in order, those of the library nvcc built for sm_90 only.
    left = te_bundle.fatbin_entries(pruned)
    native = te_bundle.fatbin_entries(hopper)
    assert [bytes(pruned[e.payload]) for e in left] == [hopper[e.payload] for e in native]
    assert counts["kept"] == len(native) and counts["entries"] > len(native)
    # Nothing outside .nv_fatbin moved, and the library still loads and runs its host code.
    start, size = te_bundle.elf_section(multi, ".nv_fatbin")
    assert len(pruned) == len(multi)
    assert pruned[:start] == multi[:start] and pruned[start + size:] == multi[start + size:]
    path = directory / "pruned.so"
    path.write_bytes(pruned)
    assert ctypes.CDLL(str(path)).host_answer() == 42
    # Pruning again changes nothing.
    again = bytearray(pruned)
    te_bundle.keep_only_arch(again, 90)
    assert again == pruned


@pytest.mark.slow
@needs_nvcc
def test_keep_only_arch_refuses_an_arch_the_library_lacks(libraries):
    _, multi, _ = libraries
    with pytest.raises(ValueError, match=r"no code for sm_75 .*sm_80, sm_90"):
        te_bundle.keep_only_arch(bytearray(multi), 75)


@pytest.mark.slow
@needs_nvcc
def test_fatbin_parser_rejects_a_damaged_section(libraries):
    _, multi, _ = libraries
    damaged = bytearray(multi)
    start, _ = te_bundle.elf_section(multi, ".nv_fatbin")
    damaged[start:start + 4] = b"\x01\x02\x03\x04"
    with pytest.raises(ValueError, match="no fatbin container at byte 0"):
        te_bundle.fatbin_entries(damaged)
    assert te_bundle.elf_section(Path(sys.executable).read_bytes(), ".nv_fatbin") is None


def _wheel(path: Path, files: dict[str, bytes]) -> None:
    """A minimal wheel holding `files`, its RECORD written from hashlib (not the code under test)."""
    dist = "demo-1.0.dist-info"
    files = {**files, f"{dist}/METADATA": b"Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n",
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    rows = [[name, "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode(),
             str(len(data))] for name, data in files.items()]
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows([*rows, [f"{dist}/RECORD", "", ""]])
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
        wheel.writestr(f"{dist}/RECORD", text.getvalue())


@pytest.mark.slow
@needs_nvcc
def test_prune_wheel_prunes_its_libraries_and_rewrites_record(libraries, tmp_path):
    _, multi, hopper = libraries
    _wheel(tmp_path / "in.whl", {"demo/lib/libdemo.so": multi, "demo/__init__.py": b"X = 1\n"})
    report = te_bundle.prune_wheel(tmp_path / "in.whl", tmp_path / "out.whl", 90)
    assert list(report) == ["demo/lib/libdemo.so"]
    with zipfile.ZipFile(tmp_path / "out.whl") as wheel:
        library = wheel.read("demo/lib/libdemo.so")
        assert wheel.read("demo/__init__.py") == b"X = 1\n"
        record = {row[0]: row[1:] for row in csv.reader(io.StringIO(wheel.read("demo-1.0.dist-info/RECORD").decode()))}
        for name in wheel.namelist():
            if not name.endswith("RECORD"):
                data = wheel.read(name)
                digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                assert record[name] == [f"sha256={digest}", str(len(data))], name
    assert {e.arch for e in te_bundle.fatbin_entries(library)} == {90}
    assert len(te_bundle.fatbin_entries(library)) == len(te_bundle.fatbin_entries(hopper))


def _bundle(path: Path, wheel: Path, python: str, digest: str | None = None) -> None:
    """A stand-in bundle in the layout `prepare` writes, holding one small wheel."""
    manifest = {"transformer_engine": "0.0", "arch": 90, "python": python, "sdist": "none.tar.gz",
                "wheels": {wheel.name: digest or hashlib.sha256(wheel.read_bytes()).hexdigest()}}
    with tarfile.open(path, "w:xz") as tar:
        tar.add(wheel, arcname=f"te-bundle/wheels/{wheel.name}")
        data = json.dumps(manifest).encode()
        info = tarfile.TarInfo("te-bundle/manifest.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


@pytest.mark.slow
def test_install_puts_the_wheels_in_the_target_and_refuses_a_wrong_or_damaged_bundle(tmp_path):
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    _wheel(wheel, {"demo/__init__.py": b"X = 1\n"})
    running = f"{sys.version_info.major}.{sys.version_info.minor}"

    _bundle(tmp_path / "good.tar.xz", wheel, running)
    te_bundle.install(tmp_path / "good.tar.xz", tmp_path / "site", jobs=1, wheel_cache=None, build=False)
    assert (tmp_path / "site" / "demo" / "__init__.py").read_bytes() == b"X = 1\n"

    _bundle(tmp_path / "other.tar.xz", wheel, "2.7")
    with pytest.raises(RuntimeError, match=f"is for Python 2.7; this is Python {running}"):
        te_bundle.install(tmp_path / "other.tar.xz", tmp_path / "site2", jobs=1, wheel_cache=None, build=False)
    _bundle(tmp_path / "damaged.tar.xz", wheel, running, digest="0" * 64)
    with pytest.raises(RuntimeError, match="demo-1.0-py3-none-any.whl does not match the manifest"):
        te_bundle.install(tmp_path / "damaged.tar.xz", tmp_path / "site3", jobs=1, wheel_cache=None, build=False)
    assert not (tmp_path / "site3" / "demo").exists()
