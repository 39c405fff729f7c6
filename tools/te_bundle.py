#!/usr/bin/env python
"""Bring Transformer Engine to an offline GPU node: a bundle for one GPU architecture, and its installer.

    # where the package registry is reachable (any machine; no GPU, no torch needed):
    python tools/te_bundle.py prepare --arch 90 --python 3.12 --output .whl/te-bundle.tar.xz
    # on the offline node (stdlib and pip only; torch with CUDA already installed there):
    python tools/te_bundle.py install .whl/te-bundle.tar.xz --target /tmp/site [--wheel-cache DIR]

Transformer Engine ships as three packages: `transformer_engine_cuXX` (the core library, one 276 MB wheel
whose shared library carries GPU code for eight architectures), `transformer_engine` (Python code) and
`transformer_engine_torch` (a C++ extension, published only as source, that must be compiled against the
node's own torch). `prepare` downloads the first two and the source of the third, keeps in the core library
only the GPU code of one architecture (the other architectures' code objects are removed from each fatbin
container and their bytes zeroed, which compression then all but erases; nothing else in the library moves),
adds the Python
packages Transformer Engine imports (pydantic, einops, packaging) and ninja for the build, and writes one
xz-compressed tar with a manifest. `install` unpacks it into a pip `--target` directory, compiles
`transformer_engine_torch` there against the node's torch (a few minutes on 16 cores), and checks that
`transformer_engine.pytorch` imports. `--wheel-cache DIR` keeps the compiled wheel, and a later install that
finds it there (or beside the bundle) skips the compilation.

Where Transformer Engine installs normally (the NGC image of docker/Dockerfile), none of this is needed.
"""

import argparse
import base64
import csv
import hashlib
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

TE_VERSION = "2.20.2"
CUDA_MAJOR = 13
FATBIN_MAGIC = 0xBA55ED50  # the header of each fatbin container in an ELF's .nv_fatbin section
# What Transformer Engine imports at run time (pydantic with its dependencies), and ninja for the build.
PYTHON_DEPENDENCIES = ("pydantic", "einops", "packaging", "ninja")
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class FatbinEntry:
    """One code object inside a fatbin container: a cubin (kind 2) or PTX (kind 1) for one architecture."""

    offset: int  # of the entry's header, in the file
    header_size: int
    payload_size: int
    kind: int
    arch: int  # 90 for sm_90 and sm_90a

    @property
    def payload(self) -> slice:
        start = self.offset + self.header_size
        return slice(start, start + self.payload_size)


def elf_section(data: bytes, name: str) -> tuple[int, int] | None:
    """(file offset, size) of a 64-bit little-endian ELF's section `name`, or None without one."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    (section_headers,) = struct.unpack_from("<Q", data, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", data, section_headers + i * entry_size) for i in range(count)]
    names_offset = sections[names_index][4]
    for name_offset, _, _, _, offset, size in sections:
        start = names_offset + name_offset
        if data[start:data.index(b"\0", start)].decode() == name:
            return offset, size
    return None


@dataclass(frozen=True)
class FatbinContainer:
    """One fatbin container (one compiled translation unit): a header, then its code objects back to back."""

    offset: int
    header_size: int
    body_size: int
    entries: tuple[FatbinEntry, ...]


def fatbin_containers(data: bytes) -> list[FatbinContainer]:
    """The fatbin containers of the ELF's .nv_fatbin section (empty without one), checked to tile it."""
    section = elf_section(data, ".nv_fatbin")
    if section is None:
        return []
    start, size = section
    containers, position, end = [], start, start + size
    while position < end:
        if data[position:position + 8] == bytes(8):  # alignment, or the space keep_only_arch freed
            position += 8
            continue
        magic, _, header_size, body_size = struct.unpack_from("<IHHQ", data, position)
        if magic != FATBIN_MAGIC:
            raise ValueError(f"no fatbin container at byte {position - start} of .nv_fatbin (magic {magic:#x})")
        entries, entry, body_end = [], position + header_size, position + header_size + body_size
        while entry < body_end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            (arch,) = struct.unpack_from("<I", data, entry + 28)
            entries.append(FatbinEntry(entry, entry_header, payload, kind, arch))
            entry += entry_header + payload
        if entry != body_end:
            raise ValueError(f"the fatbin container at byte {position - start} of .nv_fatbin is malformed")
        containers.append(FatbinContainer(position, header_size, body_size, tuple(entries)))
        position = body_end
    return containers


def fatbin_entries(data: bytes) -> list[FatbinEntry]:
    """Every code object of the ELF's .nv_fatbin section, in file order."""
    return [entry for container in fatbin_containers(data) for entry in container.entries]


def keep_only_arch(data: bytearray, arch: int) -> dict:
    """Remove from each fatbin container every code object not built for `arch` (in place): the kept ones
    move to the front of the container, its size field shrinks and the freed bytes become zeros. Each
    container stays at its offset, where the pointers the library registers with the CUDA runtime point, and
    the file keeps its size, so nothing else in the ELF moves. Returns counts."""
    containers = fatbin_containers(data)
    entries = [entry for container in containers for entry in container.entries]
    kept = [entry for entry in entries if entry.arch == arch]
    if entries and not kept:
        found = sorted({entry.arch for entry in entries})
        raise ValueError(f"no code for sm_{arch} in this library (it has {', '.join(f'sm_{a}' for a in found)})")
    for container in containers:
        body = container.offset + container.header_size
        moved = b"".join(data[e.offset:e.payload.stop] for e in container.entries if e.arch == arch)
        data[body:body + container.body_size] = moved + bytes(container.body_size - len(moved))
        struct.pack_into("<Q", data, container.offset + 8, len(moved))
    return {"entries": len(entries), "kept": len(kept), "kept_bytes": sum(e.payload_size for e in kept),
            "removed_bytes": sum(e.payload_size for e in entries if e.arch != arch)}


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def prune_wheel(source: Path, destination: Path, arch: int) -> dict:
    """Copy a wheel with keep_only_arch applied to each of its shared libraries (RECORD updated). The copy is
    stored uncompressed: the bundle's xz compresses it far better than zip's deflate would."""
    report = {}
    with zipfile.ZipFile(source) as wheel_in, zipfile.ZipFile(destination, "w", zipfile.ZIP_STORED) as wheel_out:
        members = {info.filename: wheel_in.read(info) for info in wheel_in.infolist()}
        for name, data in members.items():
            if ".so" in Path(name).name and data[:4] == b"\x7fELF" and elf_section(data, ".nv_fatbin"):
                pruned = bytearray(data)
                report[name] = keep_only_arch(pruned, arch)
                members[name] = bytes(pruned)
        (record_name,) = [name for name in members if name.endswith(".dist-info/RECORD")]
        rows = list(csv.reader(io.StringIO(members[record_name].decode())))
        for row in rows:
            if row and row[0] in report:
                row[1:3] = [_record_hash(members[row[0]]), str(len(members[row[0]]))]
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows(rows)
        members[record_name] = text.getvalue().encode()
        for name, data in members.items():
            wheel_out.writestr(name, data)
    return report


def _sha256(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def download_sdist(name: str, version: str, directory: Path, index_url: str) -> Path:
    """A source distribution through the index's JSON API (PEP 691), its sha256 checked. `pip download`
    cannot fetch transformer_engine_torch's: it runs the package's setup.py, which needs a CUDA build of torch."""
    project = name.replace("_", "-").lower()
    request = urllib.request.Request(f"{index_url.rstrip('/')}/{project}/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.load(response)["files"]
    wanted = f"{name}-{version}.tar.gz"
    matches = [f for f in files if f["filename"] == wanted]
    if not matches:
        raise RuntimeError(f"{index_url} has no {wanted}")
    path = directory / wanted
    with urllib.request.urlopen(matches[0]["url"], timeout=300) as response, open(path, "wb") as file:
        shutil.copyfileobj(response, file)
    expected = matches[0].get("hashes", {}).get("sha256")
    if expected and _sha256(path) != expected:
        raise RuntimeError(f"{wanted}: sha256 {_sha256(path)}, the index says {expected}")
    return path


def _pip(*args: str, cwd: Path | None = None) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, cwd=cwd)


def prepare(output: Path, arch: int, python: str, te_version: str, cuda_major: int, platform: str,
            index_url: str) -> dict:
    """Download, prune and pack the bundle (see the module's docstring); returns its manifest."""
    abi = "cp" + python.replace(".", "")
    target = ["--only-binary", ":all:", "--python-version", python, "--implementation", "cp", "--abi", abi,
              "--platform", platform, "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"]
    started = time.time()
    with tempfile.TemporaryDirectory() as scratch:
        downloads, bundle = Path(scratch, "downloads"), Path(scratch, "te-bundle")
        (bundle / "wheels").mkdir(parents=True)
        core, meta = f"transformer_engine_cu{cuda_major}=={te_version}", f"transformer_engine=={te_version}"
        print(f"[prepare 1/4] downloading {core} (about 280 MB) and {meta}", flush=True)
        _pip("download", "--quiet", "--no-deps", *target, "-d", str(downloads), core, meta)
        print(f"[prepare 2/4] downloading {', '.join(PYTHON_DEPENDENCIES)} for Python {python} and the "
              f"source of transformer_engine_torch {te_version}", flush=True)
        _pip("download", "--quiet", *target, "-d", str(bundle / "wheels"), *PYTHON_DEPENDENCIES)
        sdist = download_sdist("transformer_engine_torch", te_version, bundle, index_url)
        print(f"[prepare 3/4] keeping the sm_{arch} code of the core library", flush=True)
        pruned = {}
        for wheel in sorted(downloads.glob("*.whl")):
            if wheel.name.startswith(f"transformer_engine_cu{cuda_major}-"):
                pruned[wheel.name] = {"original_sha256": _sha256(wheel), "original_bytes": wheel.stat().st_size,
                                      "libraries": prune_wheel(wheel, bundle / "wheels" / wheel.name, arch)}
            else:
                shutil.copy2(wheel, bundle / "wheels")
        if not pruned:
            raise RuntimeError(f"pip downloaded no transformer_engine_cu{cuda_major} wheel for {platform}")
        manifest = {"transformer_engine": te_version, "cuda_major": cuda_major, "arch": arch, "python": python,
                    "platform": platform, "sdist": sdist.name, "pruned": pruned,
                    "wheels": {w.name: _sha256(w) for w in sorted((bundle / "wheels").glob("*.whl"))}}
        (bundle / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        print(f"[prepare 4/4] compressing into {output} (xz, a few minutes)", flush=True)
        output.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(output, "w:xz", preset=9) as tar:
            tar.add(bundle, arcname="te-bundle")
    manifest["bundle_bytes"] = output.stat().st_size
    print(f"{output}: {manifest['bundle_bytes'] / 2**20:.1f} MiB, Transformer Engine {te_version} for sm_{arch}, "
          f"Python {python}, in {time.time() - started:.0f} s")
    return manifest


def _include_dirs() -> list[Path]:
    """Where the node's CUDA, cuBLAS and cuDNN headers may be: the CUDA toolkit, and the nvidia-* wheels that
    a CUDA build of torch installs (each with an include/ folder)."""
    dirs = []
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and Path(home, "include").is_dir():
            dirs.append(Path(home, "include"))
    nvcc = shutil.which("nvcc")
    if nvcc and Path(nvcc).resolve().parent.parent.joinpath("include").is_dir():
        dirs.append(Path(nvcc).resolve().parent.parent / "include")
    for site in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *sys.path}:
        if site and Path(site, "nvidia").is_dir():
            dirs += sorted(p for p in Path(site, "nvidia").glob("*/include") if p.is_dir())
            dirs += sorted(p for p in Path(site, "nvidia").glob("*/*/include") if p.is_dir())
    return list(dict.fromkeys(d.resolve() for d in dirs))


def _check_headers(dirs: list[Path]) -> None:
    missing = [h for h in ("cuda.h", "cuda_runtime.h", "cuda_bf16.h", "cublasLt.h", "cudnn.h")
               if not any((d / h).is_file() for d in dirs)]
    if missing:
        raise RuntimeError(f"building transformer_engine_torch needs {', '.join(missing)}, found in none of: "
                           + ", ".join(map(str, dirs)) + " (set CUDA_HOME, or install the nvidia-* header wheels)")


def _build_torch_extension(bundle: Path, manifest: dict, target: Path, jobs: int) -> Path:
    """Compile transformer_engine_torch against the node's torch; returns the wheel."""
    dirs = _include_dirs()
    _check_headers(dirs)
    env = dict(os.environ)
    env.update(NVTE_PYTORCH_FORCE_BUILD="TRUE",  # no attempt to download a prebuilt wheel from GitHub
               NVTE_CUDA_ARCHS=str(manifest["arch"]), NVTE_WITH_NCCL_EP="0", MAX_JOBS=str(jobs),
               PYTHONPATH=os.pathsep.join(filter(None, [str(target), env.get("PYTHONPATH")])),
               PATH=os.pathsep.join([str(target / "bin"), env.get("PATH", "")]),
               CPATH=os.pathsep.join(filter(None, [*map(str, dirs), env.get("CPATH")])))
    out = bundle / "built"
    out.mkdir()
    started = time.time()
    print(f"building transformer_engine_torch with {jobs} jobs (a few minutes) ...", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "-w", str(out), str(bundle / manifest["sdist"])], check=True, env=env)
    (wheel,) = out.glob("transformer_engine_torch-*.whl")
    print(f"built {wheel.name} in {time.time() - started:.0f} s", flush=True)
    return wheel


def install(bundle_path: Path, target: Path, jobs: int, wheel_cache: Path | None, build: bool) -> None:
    """Unpack the bundle into `target` (a pip --target directory), build or reuse transformer_engine_torch,
    and check the imports (see the module's docstring)."""
    started = time.time()
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        with tarfile.open(bundle_path) as tar:
            tar.extractall(scratch, filter="data")
        bundle = Path(scratch, "te-bundle")
        manifest = json.loads((bundle / MANIFEST).read_text())
        running = f"{sys.version_info.major}.{sys.version_info.minor}"
        if running != manifest["python"]:
            raise RuntimeError(f"{bundle_path} is for Python {manifest['python']}; this is Python {running}")
        for name, digest in manifest["wheels"].items():
            if _sha256(bundle / "wheels" / name) != digest:
                raise RuntimeError(f"{bundle_path}: {name} does not match the manifest (a damaged bundle)")
        print(f"installing Transformer Engine {manifest['transformer_engine']} (sm_{manifest['arch']}) into "
              f"{target}", flush=True)
        _pip("install", "--quiet", "--no-index", "--no-deps", "--no-compile", "--upgrade", "--target",
             str(target), *map(str, sorted((bundle / "wheels").glob("*.whl"))))
        if not build:
            return
        pattern = f"transformer_engine_torch-{manifest['transformer_engine']}-cp{running.replace('.', '')}-*.whl"
        cached = sorted(p for d in (wheel_cache, bundle_path.parent) if d and d.is_dir() for p in d.glob(pattern))
        wheel = cached[0] if cached else _build_torch_extension(bundle, manifest, target, jobs)
        if cached:
            print(f"using {wheel} (built earlier)", flush=True)
        _pip("install", "--quiet", "--no-index", "--no-deps", "--no-compile", "--upgrade", "--target",
             str(target), str(wheel))
        if wheel_cache and not cached:
            wheel_cache.mkdir(parents=True, exist_ok=True)
            shutil.copy2(wheel, wheel_cache)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")])))
    check = ("import torch, transformer_engine, transformer_engine.pytorch as te; "
             "print('transformer_engine', transformer_engine.__version__, 'imports; torch', torch.__version__)")
    subprocess.run([sys.executable, "-c", check], check=True, env=env)
    print(f"installed in {time.time() - started:.0f} s; use it with PYTHONPATH={target}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("prepare", help="download, prune and pack a bundle (needs the package registry)")
    p.add_argument("--arch", type=int, default=90, help="the GPU architecture to keep: 90 for H100/H200")
    p.add_argument("--python", default="3.12", help="the node's Python version (the bundle's wheels match it)")
    p.add_argument("--te-version", default=TE_VERSION)
    p.add_argument("--cuda-major", type=int, default=CUDA_MAJOR, help="the CUDA major version of the node's torch")
    p.add_argument("--platform", default="manylinux_2_28_x86_64")
    p.add_argument("--index-url", default="https://pypi.org/simple", help="for transformer_engine_torch's source")
    p.add_argument("--output", type=Path, required=True, help="the bundle to write (.tar.xz)")
    i = commands.add_parser("install", help="install a bundle on the offline node")
    i.add_argument("bundle", type=Path)
    i.add_argument("--target", type=Path, required=True, help="a pip --target directory; put it on PYTHONPATH")
    i.add_argument("--jobs", type=int, default=os.cpu_count(), help="compile jobs for transformer_engine_torch")
    i.add_argument("--wheel-cache", type=Path, help="keep the compiled transformer_engine_torch here, and reuse it")
    i.add_argument("--no-build", dest="build", action="store_false",
                   help="install the core and Python packages only (no transformer_engine_torch, no import check)")
    args = parser.parse_args()
    try:
        if args.command == "prepare":
            prepare(args.output, args.arch, args.python, args.te_version, args.cuda_major, args.platform,
                    args.index_url)
        else:
            if not args.bundle.is_file():
                raise RuntimeError(f"{args.bundle}: no such bundle (make one with `te_bundle.py prepare`)")
            install(args.bundle, args.target, args.jobs, args.wheel_cache, args.build)
    except (RuntimeError, ValueError, OSError, subprocess.CalledProcessError, tarfile.TarError) as error:
        sys.exit(f"te_bundle.py {args.command}: error: {error}")


if __name__ == "__main__":
    main()
