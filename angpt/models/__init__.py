"""The model families: anGPT, GPT+ and nGPT."""

from angpt.models.config import MODEL_FAMILIES, AnGPTConfig, model_config
from angpt.models.gpt import WEIGHT_CONSTRAINTS, build_model

__all__ = ["MODEL_FAMILIES", "WEIGHT_CONSTRAINTS", "AnGPTConfig", "build_model", "model_config"]
