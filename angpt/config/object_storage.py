"""Datasets in object storage, as Megatron-LM reads them: a prefix `s3://bucket/key` (boto3) or `msc://profile/key`
(NVIDIA's multistorageclient) is opened by megatron-core's IndexedDataset, which downloads the .idx into
--object-storage-cache-path and reads the .bin by ranged GETs (megatron/core/datasets/object_storage_utils.py,
indexed_dataset.py). The checks angpt makes before megatron-core reads the data read the same objects through
here: the .idx from megatron-core's cached copy (its cache_index_file, at its get_index_cache_path), the .json and
the .bin's size with the same client (here, beside angpt.config.files, so that the flags' checks can name a
missing client). boto3 is imported only where an s3:// prefix is read."""

from __future__ import annotations

import functools
import importlib
from typing import Optional

# megatron-core's (object_storage_utils.S3_PREFIX, MSC_PREFIX), here without importing it: the flags' checks and
# angpt.data.indexed read these, without torch (tools/preprocess_data.py starts without it), which megatron-core's
# import brings (7-10 s).
S3_PREFIX, MSC_PREFIX = "s3://", "msc://"


def is_object_storage_path(path: str) -> bool:
    """megatron-core's is_object_storage_path: the prefix of an s3:// or msc:// object."""
    return path.startswith((S3_PREFIX, MSC_PREFIX))


def _megatron(name: str):
    """megatron-core's module `name`, imported where object storage is read (it imports torch)."""
    return importlib.import_module(f"megatron.core.{name}")


class ObjectStorageError(ValueError):
    """An object that cannot be read; the message names its path."""


class MissingObject(ObjectStorageError):
    def __init__(self, path: str):
        super().__init__(f"{path}: no such object")


BOTO3_MISSING = "reading s3:// needs boto3 (megatron-core reads S3 with it): pip install boto3"
MSC_MISSING = ("reading msc:// needs the multistorageclient package, which is not installed: pip install "
               "multi-storage-client")


def client_missing(path: str) -> Optional[str]:
    """Why `path`'s object storage cannot be read here (its client is not installed), or None."""
    if path.startswith(S3_PREFIX):
        try:
            import boto3  # noqa: F401, PLC0415 (optional: only s3:// prefixes need it)
        except ImportError:
            return BOTO3_MISSING
    elif path.startswith(MSC_PREFIX) and _megatron("msc_utils").msc is None:
        return MSC_MISSING
    return None


def _s3():
    """An S3 client as megatron-core makes its own (boto3's defaults: the AWS_* environment, ~/.aws)."""
    try:
        import boto3  # noqa: PLC0415 (optional, as above)
    except ImportError:
        raise ObjectStorageError(BOTO3_MISSING) from None
    return boto3.client("s3")


def _s3_call(path: str, method: str, **kwargs) -> dict:
    """An S3 request on `path`'s object; a missing object or bucket, or any error of the client, in one line."""
    from botocore.exceptions import BotoCoreError, ClientError  # noqa: PLC0415 (boto3's, optional as boto3)

    bucket, key = _megatron("datasets.object_storage_utils").parse_s3_path(path)
    try:
        return getattr(_s3(), method)(Bucket=bucket, Key=key, **kwargs)
    except ClientError as error:
        code = error.response.get("Error", {}).get("Code")
        if code in ("404", "NoSuchKey", "NoSuchBucket"):
            raise MissingObject(path) from None
        raise ObjectStorageError(f"{path}: {error}") from None
    except BotoCoreError as error:
        raise ObjectStorageError(f"{path}: {error}") from None


def _msc():
    return _megatron("msc_utils").MultiStorageClientFeature.import_package()


def object_size(path: str) -> int:
    """The size in bytes of the object at `path` (an ObjectStorageError naming it where there is none)."""
    if path.startswith(S3_PREFIX):
        return _s3_call(path, "head_object")["ContentLength"]
    if not _msc().exists(path):
        raise MissingObject(path)
    return _msc().info(path).content_length


def exists(path: str) -> bool:
    try:
        object_size(path)
    except MissingObject:
        return False
    return True


def read_bytes(path: str) -> bytes:
    """The whole object (a dataset's .json)."""
    if path.startswith(S3_PREFIX):
        return _s3_call(path, "get_object")["Body"].read()
    if not _msc().exists(path):
        raise MissingObject(path)
    with _msc().open(path, "rb") as file:
        return file.read()


@functools.cache
def cached_index(prefix: str, cache_path: Optional[str]) -> str:
    """The local copy of `prefix`.idx, downloaded by megatron-core's cache_index_file to where its IndexedDataset
    reads it (get_index_cache_path under --object-storage-cache-path); once per process."""
    if cache_path is None:
        raise ObjectStorageError(f"{prefix}: a dataset in object storage needs --object-storage-cache-path, where "
                                 "megatron-core keeps its .idx")
    idx = prefix + ".idx"
    object_size(idx)  # a missing object named in one line, before megatron-core's download asserts
    utils = _megatron("datasets.object_storage_utils")
    local = utils.get_index_cache_path(idx, utils.ObjectStorageConfig(path_to_idx_cache=cache_path))
    utils.cache_index_file(idx, local)
    return local
