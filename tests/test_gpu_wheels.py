"""tools/gpu_wheels.py: the wheels for the GPU machine, held to what one device call carries."""

import importlib.util
import os

import pytest

from conftest import ROOT


def load_tool():
    spec = importlib.util.spec_from_file_location("gpu_wheels", os.path.join(ROOT, "tools", "gpu_wheels.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("extra_bytes, refused", [(0, False), (1, True)])
def test_the_wheels_are_refused_one_byte_over_the_limit(tmp_path, extra_bytes, refused):
    tool = load_tool()
    (tmp_path / "a-1.0-py3-none-any.whl").write_bytes(b"x" * 2**20)
    (tmp_path / "b-1.0-py3-none-any.whl").write_bytes(b"x" * (2**20 + extra_bytes))
    (tmp_path / "notes.txt").write_bytes(b"x" * 2**20)  # not a wheel: not carried by gpu_checks.sh's install
    total, error = tool.check_total([str(tmp_path)], limit_mib=2)
    assert total == 2 * 2**20 + extra_bytes
    assert (error is not None) == refused
    if refused:
        assert "over the 2 MiB" in error and "b-1.0-py3-none-any.whl" in error


def test_an_empty_folder_is_within_the_limit(tmp_path):
    assert load_tool().check_total([str(tmp_path)], limit_mib=64) == (0, None)


def test_the_bundle_and_every_file_of_the_corpus_count(tmp_path):
    tool = load_tool()
    wheels, corpus = tmp_path / "whl", tmp_path / "data" / "shakespeare"
    (corpus / "tokenizer").mkdir(parents=True)
    wheels.mkdir()
    (wheels / "te-sm90-cp312.tar.xz").write_bytes(b"x" * 2**20)
    (wheels / "a-1.0-py3-none-any.whl").write_bytes(b"x" * 2**19)
    (corpus / "train_text_document.bin").write_bytes(b"x" * 2**19)
    (corpus / "tokenizer" / "tokenizer.json").write_bytes(b"x" * 100)
    total, error = tool.check_total([str(wheels), str(corpus)], limit_mib=2, also={"the checkout": 1})
    assert total == 2 * 2**20 + 100 + 1
    assert "te-sm90-cp312.tar.xz" in error and "over the 2 MiB" in error


def test_the_checkout_counts_its_tracked_files():
    size = load_tool().checkout_bytes()
    assert os.path.getsize(os.path.join(ROOT, "setup.py")) < size < 64 * 2**20


def test_the_wheels_are_those_of_the_versions_installed_here():
    tool = load_tool()
    assert tool.pinned("megatron-core") == "megatron-core==0.16.1"
    assert tool.pinned("gigatoken") == "gigatoken==0.10.0"
