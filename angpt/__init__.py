"""angpt: the Approximately Normalized GPT (Franke et al., NeurIPS 2025) on megatron-core."""

__version__ = "0.1.0"
