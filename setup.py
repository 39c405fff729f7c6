"""angpt: the Approximately Normalized GPT on megatron-core.

The fused kernels in csrc/ are built with the installed torch (install it first, and build without pip's
build isolation: `pip install --no-build-isolation -e .`); without torch the package installs without
them and runs the PyTorch implementations.
"""

import glob
import os
import sys

from setuptools import find_packages, setup

# The compiler flags of each vector ISA that torch dispatches to on x86 (as torch builds its own kernels).
CPU_CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "DEFAULT": [],
}


def kernel_extensions():
    """The extension angpt.kernels._fused_<isa>, for the vector ISA that torch uses on the build machine
    (ANGPT_CPU_CAPABILITY overrides it). The ISA is in the module's name, so that a machine without it never
    imports it. CUDA sources are added only when torch is a CUDA build and a CUDA toolkit is present."""
    try:
        import torch  # noqa: PLC0415 (optional at build time: installs without the kernels)
        from torch.utils import cpp_extension  # noqa: PLC0415 (as torch)
    except ImportError:
        print("angpt: torch is not importable at build time; installing without the fused kernels", file=sys.stderr)
        return [], {}
    capability = os.environ.get("ANGPT_CPU_CAPABILITY") or torch.backends.cpu.get_cpu_capability()
    if capability not in CPU_CAPABILITY_FLAGS:
        capability = "DEFAULT"
    # ninja from the same environment, even when it is not activated.
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    sources = ["csrc/angpt_kernels.cpp", *sorted(glob.glob("csrc/cpu/*.cpp"))]
    # The -Wno flags silence warnings inside torch's own vector headers (torch builds with them too).
    cxx = ["-O3", "-fopenmp", "-Wno-unknown-pragmas", "-Wno-maybe-uninitialized", "-Wno-uninitialized",
           f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}",
           *CPU_CAPABILITY_FLAGS[capability]]
    kwargs = dict(name=f"angpt.kernels._fused_{capability.lower()}", extra_link_args=["-fopenmp"])
    if torch.version.cuda and cpp_extension.CUDA_HOME:
        extension = cpp_extension.CUDAExtension(
            sources=sources + sorted(glob.glob("csrc/cuda/*.cu")),
            extra_compile_args={"cxx": cxx + ["-DANGPT_WITH_CUDA"], "nvcc": ["-O3"]},
            **kwargs,
        )
    else:
        extension = cpp_extension.CppExtension(sources=sources, extra_compile_args=cxx, **kwargs)
    return [extension], {"build_ext": cpp_extension.BuildExtension}


ext_modules, cmdclass = kernel_extensions()

setup(
    name="angpt",
    version="0.1.0",
    description="Megatron-style distributed pretraining of anGPT, the Approximately Normalized GPT",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["angpt", "angpt.*"]),
    install_requires=[
        # CPU machines install torch==2.13.0 first (requirements/cpu.txt); GPU images bring their own.
        "torch>=2.6",
        "megatron-core==0.16.1",
        "numpy",
        # Tokenization (tools/preprocess_data.py, tools/train_tokenizer.py) and its progress bar.
        "tokenizers>=0.20",
        "tiktoken>=0.7",
        # tools/preprocess_data.py's fast backend (--tokenizer-backend): the same ids as tokenizers and tiktoken,
        # 15-70x faster. Pinned: the tool checks its ids against the tokenizer's own library at start-up and falls
        # back where they differ, and the tests hold this version to every document of a corpus.
        "gigatoken==0.10.0",
        # Megatron-LM's SentencePieceTokenizer, GPTSentencePieceTokenizer and Llama2Tokenizer (megatron-core's
        # tokenizer library reads the .model with it).
        "sentencepiece",
        "tqdm",
        # tools/preprocess_data.py: --split-sentences (Punkt, as Megatron-LM; pure Python, works offline without
        # trained parameters; its sentence-end pattern is linear since 3.6.6, CVE-2021-43854; tested with 3.10)
        # and Parquet input, read in batches of rows (pyarrow 16: string_view columns).
        "nltk>=3.9",
        "pyarrow>=16",
        # megatron-core's distributed checkpointing hangs without it, and does not declare it; the --save lock
        # checks its holder's process with it.
        "psutil",
        # megatron-core builds --num-distributed-optimizer-instances' groups with it, and does not declare it.
        "einops",
        # Checkpoint digests at memory speed (angpt/training/digests.py; blake2b and sha256 hash ten times slower).
        "xxhash",
        # Training metrics as TensorBoard scalars (angpt/telemetry/metrics.py).
        "tensorboard",
        # `angpt.pretrain --config run.yaml`.
        "pyyaml",
        # Hugging Face export and import (angpt/hf/, tools/convert_to_hf.py, tools/convert_from_hf.py).
        "transformers>=5",
        "safetensors",
    ],
    extras_require={
        # lm-eval (and the accelerate its Hugging Face back end imports) runs on an exported model in the tests;
        # pytest-xdist runs the test files on parallel workers. Its --dist loadgroup (tests sharing a fixture on
        # one worker) sets Item._nodeid, which pytest 9.2 no longer reads: every test is scheduled on its own
        # and each worker builds the shared fixtures again (pytest-xdist 3.8). ruff (`make lint`,
        # tests/test_lint.py) within one minor version: its rules change between minor versions. wandb: the
        # test of the W&B sink (tests/test_wandb.py, offline). mutmut: `make mutation` (tools/mutation.py reads
        # its result files and its mutant names, which change between versions: pinned). moto: a local S3 in the
        # process for the tests of s3:// datasets (tests/test_object_storage.py; its mock_aws is moto 5's).
        "test": ["pytest>=8,<9.2", "pytest-xdist>=3.5", "lm_eval>=0.4", "accelerate", "angpt[bench,wandb,s3]",
                 "ruff>=0.17.6,<0.18", "mutmut==3.8.1", "moto[s3]>=5,<6"],
        # --wandb-project: the training metrics in a Weights & Biases run too.
        "wandb": ["wandb"],
        # --data-path s3://bucket/prefix: megatron-core reads S3 with boto3 (msc:// prefixes need NVIDIA's
        # multi-storage-client, installed by hand).
        "s3": ["boto3"],
        # Plots and fits of benchmarks/convergence.py and tools/fit_scaling_law.py.
        "bench": ["matplotlib", "scipy"],
        # GPU only; apex is built from source inside NVIDIA's containers and is never required.
        # nvidia-ml-py: GPU utilisation, power and temperature in the training metrics.
        "gpu": ["transformer-engine[pytorch]", "nvidia-ml-py"],
    },
    entry_points={"console_scripts": ["angpt-pretrain=angpt.pretrain:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
