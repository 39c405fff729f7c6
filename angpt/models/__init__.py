"""The model families: anGPT, GPT+ and nGPT as megatron-core layer specs, their layers and learnable scales,
and the model's math that is not a layer (the normalization factors, bounding). It imports `angpt.config`
(the enumerated choices, Transformer Engine checks) and `angpt.kernels`, never training or data.
"""

from angpt.models.config import MODEL_FAMILIES, AnGPTConfig, model_config
from angpt.models.gpt import WEIGHT_CONSTRAINTS, build_model

__all__ = ["MODEL_FAMILIES", "WEIGHT_CONSTRAINTS", "AnGPTConfig", "build_model", "model_config"]
