"""angpt: the Approximately Normalized GPT on megatron-core."""

from setuptools import find_packages, setup

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
        "tqdm",
        # megatron-core's distributed checkpointing hangs without it, and does not declare it.
        "psutil",
        # Training metrics as TensorBoard scalars (angpt/monitoring.py).
        "tensorboard",
    ],
    extras_require={
        "test": ["pytest>=8"],
        # GPU only; apex is built from source inside NVIDIA's containers and is never required.
        # nvidia-ml-py: GPU utilisation, power and temperature in the training metrics.
        "gpu": ["transformer-engine[pytorch]", "nvidia-ml-py"],
    },
    entry_points={"console_scripts": ["angpt-pretrain=angpt.pretrain:main"]},
)
