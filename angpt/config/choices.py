"""The values each enumerated model setting may take: one place for the model config's checks
(angpt.models.config) and the command line's choices (angpt.config.arguments). It imports nothing, so that the
command line parses (and `--help` prints) before torch and megatron-core are loaded.
"""

MODEL_FAMILIES = ("angpt", "gptplus", "ngpt")
FAMILY_NAMES = {"angpt": "anGPT", "gptplus": "GPT+", "ngpt": "nGPT"}  # as the paper writes them
# The normalization factors: as derived, all 1, or the exact 1/||x|| (docs/model.md, Normalization factors).
FACTOR_MODES = ("analytic", "one", "exact")
# The two readings of nu_p (docs/model.md, Normalization factors).
NU_P_READINGS = ("one", "sqrt_h_over_d")
POST_NORMS = ("l2", "none")
RESIDUALS = ("lerp", "plain")
# megatron-core's layers ("local", the default and the CPU path) or Transformer Engine's (GPU, needed for FP8).
TRANSFORMER_IMPLS = ("local", "transformer_engine")
# The weights' dtype of a Hugging Face export (tools/convert_to_hf.py).
EXPORT_DTYPES = ("float32", "bfloat16")
