"""Datasets in object storage, as Megatron-LM reads them (--data-path s3://bucket/prefix with
--object-storage-cache-path): megatron-core's IndexedDataset, its .idx downloaded to the cache path and its .bin
read by ranged GETs, against a local S3 that moto serves in this process. The data is the pydoc corpus that
tools/preprocess_data.py writes (conftest.pydoc_corpus), uploaded as it is."""

import json
import logging
import os
import shutil
import sys
import types

import boto3
import pytest
import torch
from megatron.core import msc_utils
from megatron.core.datasets import object_storage_utils
from megatron.core.datasets.indexed_dataset import _S3BinReader
from moto import mock_aws
from test_trainer import losses

from angpt.config import megatron_lm, object_storage
from angpt.config.arguments import parse_args
from angpt.config.sections import DataSection
from angpt.data.gpt_datasets import build_datasets, dataset_vocabulary
from angpt.data.indexed import IndexedDatasetError

from conftest import in_process_trainer

BUCKET = "corpus"
TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1", "--eval-iters", "1",
        "--eval-interval", "2"]


@pytest.fixture
def s3(pydoc_corpus, monkeypatch):
    """A local S3 (moto, in this process) holding the pydoc corpus's train and valid datasets under
    s3://corpus/pydoc/; the credentials are moto's stand-ins, so that no request leaves the process."""
    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    with mock_aws():
        client = boto3.client("s3")
        client.create_bucket(Bucket=BUCKET)
        for split in ("train", "valid"):
            for ext in (".bin", ".idx", ".json"):
                client.upload_file(f"{local(pydoc_corpus, split)}{ext}", BUCKET, f"pydoc/{split}{ext}")
        yield client


def stored(split: str) -> str:
    return f"s3://{BUCKET}/pydoc/{split}"


def local(corpus, split: str) -> str:
    return str(corpus / f"{split}_text_document")


def refusal(argv, capsys) -> str:
    with pytest.raises(SystemExit):
        parse_args(argv, world_size=1)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    return line.removeprefix("angpt.pretrain: error: ").removesuffix(" (see --help)")


def test_the_prefixes_are_megatron_cores():
    """angpt reads the prefixes without importing megatron-core (tools/preprocess_data.py starts without torch)."""
    assert (object_storage.S3_PREFIX, object_storage.MSC_PREFIX) == (object_storage_utils.S3_PREFIX,
                                                                     object_storage_utils.MSC_PREFIX)
    for path in ("s3://b/k", "msc://p/k", "s3:/b/k", "/data/s3://b", "S3://b/k", "gs://b/k", ""):
        assert object_storage.is_object_storage_path(path) == object_storage_utils.is_object_storage_path(path)


def test_batches_read_from_s3_are_the_local_ones_and_the_idx_is_cached(s3, pydoc_corpus, tmp_path, single_process):
    """(a) every sample of both splits read through s3:// equals, bit for bit, the one read from the local prefix;
    (b) the .idx is megatron-core's download under --object-storage-cache-path (bucket/key), the local .idx's bytes;
    the .bin is read by megatron-core's S3 reader, not from a file."""
    cache = tmp_path / "idx_cache"
    remote = DataSection(train_data_path=(stored("train"),), valid_data_path=(stored("valid"),),
                         data_cache_path=str(tmp_path / "remote"), object_storage_cache_path=str(cache),
                         mmap_bin_files=False)
    on_disk = DataSection(train_data_path=(local(pydoc_corpus, "train"),),
                          valid_data_path=(local(pydoc_corpus, "valid"),), data_cache_path=str(tmp_path / "local"))
    vocabulary = dataset_vocabulary(remote)
    assert vocabulary == dataset_vocabulary(on_disk)
    read = {name: build_datasets(data, vocabulary, 32, 1234, [64, 16, 0])
            for name, data in (("remote", remote), ("local", on_disk))}
    for split in (0, 1):
        remote_dataset, local_dataset = read["remote"][split], read["local"][split]
        assert isinstance(remote_dataset.dataset.bin_reader, _S3BinReader)
        assert len(remote_dataset) == len(local_dataset) >= 16
        for index in range(len(local_dataset)):
            a, b = remote_dataset[index], local_dataset[index]
            assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)
    for split in ("train", "valid"):
        cached = cache / BUCKET / "pydoc" / f"{split}.idx"
        assert cached.read_bytes() == open(f"{local(pydoc_corpus, split)}.idx", "rb").read()
    assert sorted(p.name for p in (cache / BUCKET / "pydoc").iterdir()) == ["train.idx", "valid.idx"]


@pytest.mark.slow  # an in-process run
def test_a_run_on_s3_data_gives_the_losses_of_the_local_copy(s3, pydoc_corpus, tmp_path):
    """(c) 4 steps with evaluations on s3:// data and on the same files locally: the same losses, every one."""
    runs = {}
    for name, (train, valid, extra) in {
            "local": (local(pydoc_corpus, "train"), local(pydoc_corpus, "valid"), []),
            "s3": (stored("train"), stored("valid"),
                   ["--object-storage-cache-path", str(tmp_path / "idx_cache"), "--no-mmap-bin-files"])}.items():
        save = tmp_path / name
        argv = [*TINY, "--train-iters", "4", "--train-data-path", train, "--valid-data-path", valid,
                "--data-cache-path", str(tmp_path / f"{name}_cache"), "--save", str(save), "--save-interval", "100",
                *extra]
        assert in_process_trainer(argv).run() == 0
        runs[name] = (losses(save), [r["lm_loss"] for r in map(json.loads, open(save / "metrics.jsonl"))
                                     if r["kind"] == "eval"])
    assert sorted(runs["s3"][0]) == [1, 2, 3, 4] and len(runs["s3"][1]) >= 2
    print("losses (train, eval) on s3:", runs["s3"])
    assert runs["s3"] == runs["local"]


# -- refusals, each at its boundary


def test_a_prefix_in_object_storage_needs_the_cache_path_and_no_memory_map(s3, capsys):
    """megatron-core's asserts (GPTDataset.build_low_level_dataset, IndexedDataset.initialize) as one line each."""
    argv = [*TINY, "--train-iters", "1", "--data-path", stored("train")]
    assert refusal(argv, capsys) == (
        f"--data-path {stored('train')}: a dataset in object storage needs --object-storage-cache-path, where "
        "megatron-core keeps its .idx (Megatron-LM's assert)")
    argv += ["--object-storage-cache-path", "cache"]
    assert refusal(argv, capsys) == (
        f"--data-path {stored('train')}: megatron-core reads a .bin in object storage by ranged GETs, not through a "
        "memory map: give --no-mmap-bin-files (its IndexedDataset asserts)")
    config = parse_args([*argv, "--no-mmap-bin-files"], world_size=1)
    assert config.data.object_storage_cache_path == "cache"


@pytest.mark.parametrize("missing", [".bin", ".idx"])
def test_a_missing_object_is_named(s3, capsys, missing):
    s3.delete_object(Bucket=BUCKET, Key=f"pydoc/train{missing}")
    argv = [*TINY, "--train-iters", "1", "--data-path", stored("train"), "--object-storage-cache-path", "c",
            "--no-mmap-bin-files"]
    assert refusal(argv, capsys) == (f"--data-path {stored('train')}: no {stored('train')}{missing}")


def test_a_missing_bucket_is_named(s3, capsys):
    argv = [*TINY, "--train-iters", "1", "--train-data-path", "s3://elsewhere/pydoc/train",
            "--object-storage-cache-path", "c", "--no-mmap-bin-files"]
    assert refusal(argv, capsys) == ("--train-data-path s3://elsewhere/pydoc/train: no "
                                          "s3://elsewhere/pydoc/train.bin")


def test_the_data_checks_name_a_missing_or_truncated_object(s3, pydoc_corpus, tmp_path):
    """The checks before megatron-core reads the data (here past the flags' checks, as a dataset changed since):
    a .idx gone, and a .bin shorter than its .idx indexes, each named by its s3:// path."""
    data = DataSection(data_path=(stored("train"),), object_storage_cache_path=str(tmp_path / "c"),
                       mmap_bin_files=False)
    whole = open(f"{local(pydoc_corpus, 'train')}.bin", "rb").read()
    s3.put_object(Bucket=BUCKET, Key="pydoc/train.bin", Body=whole[:-2])
    with pytest.raises(IndexedDatasetError, match=f"^{stored('train')}.bin: {len(whole) - 2} bytes, but "
                                                  f"{stored('train')}.idx indexes {len(whole)}: truncated"):
        dataset_vocabulary(data)
    s3.delete_object(Bucket=BUCKET, Key="pydoc/valid.idx")
    data = DataSection(data_path=(stored("valid"),), object_storage_cache_path=str(tmp_path / "c"),
                       mmap_bin_files=False)
    with pytest.raises(IndexedDatasetError, match=f"^{stored('valid')}.idx: no such object$"):
        dataset_vocabulary(data)


def test_the_metadata_is_read_from_the_bucket(s3, pydoc_corpus, tmp_path, caplog):
    """The .json beside the objects: its counts are checked against the .idx and .bin; a .json without max_token_id
    leaves the .bin unscanned (it would be downloaded whole), said in one line; the batches' ids are checked."""
    metadata = json.loads(open(f"{local(pydoc_corpus, 'train')}.json").read())
    data = DataSection(data_path=(stored("train"),), object_storage_cache_path=str(tmp_path / "c"),
                       mmap_bin_files=False)
    s3.put_object(Bucket=BUCKET, Key="pydoc/train.json", Body=json.dumps({**metadata, "tokens": 1}))
    with pytest.raises(IndexedDatasetError, match=f"^{stored('train')}.json: records 1 tokens, but "):
        dataset_vocabulary(data)
    del metadata["max_token_id"]
    s3.put_object(Bucket=BUCKET, Key="pydoc/train.json", Body=json.dumps(metadata))
    with caplog.at_level(logging.INFO, logger="angpt"):
        assert dataset_vocabulary(data).vocab_size == metadata["vocab_size"]
    assert [r.getMessage() for r in caplog.records] == [
        f"{stored('train')}.bin: its token ids are not scanned before training (in object storage, and no "
        "max_token_id in a .json): the trainer checks those of every batch it reads"]


def test_boto3_missing_is_said_in_one_line(s3, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "boto3", None)  # `import boto3` raises ImportError
    argv = [*TINY, "--train-iters", "1", "--data-path", stored("train"), "--object-storage-cache-path", "c",
            "--no-mmap-bin-files"]
    assert refusal(argv, capsys) == (f"--data-path {stored('train')}: reading s3:// needs boto3 (megatron-core "
                                          "reads S3 with it): pip install boto3")


def test_msc_without_multistorageclient_is_said_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr(msc_utils, "msc", None)  # as where it is not installed (as here; wherever it is, too)
    argv = [*TINY, "--train-iters", "1", "--data-path", "msc://profile/pydoc/train", "--object-storage-cache-path",
            "c", "--no-mmap-bin-files"]
    assert refusal(argv, capsys) == ("--data-path msc://profile/pydoc/train: reading msc:// needs the "
                                          "multistorageclient package, which is not installed: pip install "
                                          "multi-storage-client")


def test_the_cache_path_without_object_storage_changes_nothing_said_in_one_line(pydoc_corpus):
    config = parse_args([*TINY, "--train-iters", "1", "--data-path", local(pydoc_corpus, "train"),
                         "--object-storage-cache-path", "c"], world_size=1)
    assert ("--object-storage-cache-path: no dataset prefix is in object storage (s3:// or msc://): it changes "
            "nothing (as in Megatron-LM)") in megatron_lm.notes(config)
    mock = parse_args([*TINY, "--train-iters", "1", "--mock-data", "--vocab-size", "64",
                       "--object-storage-cache-path", "c"], world_size=1)
    assert any(line.startswith("--object-storage-cache-path: no dataset") for line in megatron_lm.notes(mock))
    assert not any("object" in line for line in megatron_lm.notes(parse_args(
        [*TINY, "--train-iters", "1", "--data-path", local(pydoc_corpus, "train")], world_size=1)))


def test_what_a_prefix_in_object_storage_changes_of_other_flags_is_said(s3, tmp_path):
    """megatron-core's index caches go beside the prefix read as a local path without --data-cache-path; it reads
    such a prefix's counts from its .idx, not from --per-dataset-sequences-path (which needs no entry for it)."""
    counts = tmp_path / "counts.json"
    counts.write_text("{}")
    argv = [*TINY, "--train-iters", "1", "--data-path", stored("train"), "--object-storage-cache-path", "c",
            "--no-mmap-bin-files", "--per-dataset-sequences-path", str(counts)]
    notes = megatron_lm.notes(parse_args(argv, world_size=1))
    assert {
        f"{stored('train')}: without --data-cache-path megatron-core writes the datasets' index caches beside the "
        f"prefix read as a local path, under ./s3:/{BUCKET}/pydoc/train/cache here (as in Megatron-LM)",
        "--per-dataset-sequences-path: megatron-core reads the counts of a prefix in object storage from its .idx, "
        "not from the file (as in Megatron-LM)"} <= set(notes)
    assert not any("index caches" in line for line in megatron_lm.notes(
        parse_args([*argv, "--data-cache-path", str(tmp_path)], world_size=1)))


class StandInMultiStorageClient:
    """multistorageclient's calls that megatron-core (download_file, resolve_storage_client, types.Range) and angpt
    (exists, info, open) make, over a local directory as the profile `profile`: where the package is not installed
    (here), msc:// prefixes are read through it as through the package."""

    def __init__(self, root):
        self.root = root
        self.types = types.SimpleNamespace(Range=lambda offset, size: (offset, size))

    def _local(self, path: str) -> str:
        """The profile's file; a local path as it is (the package reads those too, and megatron-core opens local .bin
        files through it wherever it is installed)."""
        return os.path.join(self.root, path.removeprefix("msc://profile/")) if path.startswith("msc://") else path

    def exists(self, path):
        return os.path.isfile(self._local(path))

    def info(self, path):
        return types.SimpleNamespace(content_length=os.path.getsize(self._local(path)))

    def open(self, path, mode="rb", **kwargs):
        return open(self._local(path), mode)

    def download_file(self, remote, local):
        os.makedirs(os.path.dirname(local), exist_ok=True)
        shutil.copyfile(self._local(remote), local)

    def resolve_storage_client(self, path):
        def read(path, byte_range):
            with open(path, "rb") as file:
                file.seek(byte_range[0])
                return file.read(byte_range[1])
        return types.SimpleNamespace(read=read), self._local(path)


def test_msc_prefixes_are_read_through_multistorageclient_where_it_is_installed(pydoc_corpus, tmp_path, monkeypatch,
                                                                                  single_process):
    monkeypatch.setattr(msc_utils, "msc", StandInMultiStorageClient(str(pydoc_corpus)))
    monkeypatch.setattr(msc_utils.MultiStorageClientFeature, "_enabled", True)
    cache = tmp_path / "idx_cache"
    remote = DataSection(train_data_path=("msc://profile/train_text_document",), object_storage_cache_path=str(cache),
                         data_cache_path=str(tmp_path / "remote"), mmap_bin_files=False)
    on_disk = DataSection(train_data_path=(local(pydoc_corpus, "train"),), data_cache_path=str(tmp_path / "local"))
    vocabulary = dataset_vocabulary(remote)
    assert vocabulary == dataset_vocabulary(on_disk)
    (remote_train, _, _), (local_train, _, _) = (build_datasets(data, vocabulary, 32, 1234, [16, 0, 0])
                                                 for data in (remote, on_disk))
    assert type(remote_train.dataset.bin_reader).__name__ == "_MultiStorageClientBinReader"
    assert all(torch.equal(remote_train[i]["tokens"], local_train[i]["tokens"]) for i in range(len(local_train)))
    assert (cache / "profile" / "train_text_document.idx").is_file()
    parse_args([*TINY, "--train-iters", "1", "--data-path", "msc://profile/train_text_document",
                "--object-storage-cache-path", str(cache), "--no-mmap-bin-files"], world_size=1)
