"""angpt: the Approximately Normalized GPT (Franke et al., NeurIPS 2025) on megatron-core.

Its folders are layers, lowest first: kernels and data; config; models; megatron_compat and telemetry;
training; hf and experiments; then the entry point, pretrain.py (README, Where things are).
"""

__version__ = "0.1.0"
