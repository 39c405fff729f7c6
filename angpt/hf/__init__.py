"""Hugging Face interop: export of a checkpoint of any layout to a `transformers` model directory, import
back for `--finetune`, and the checks of an export; `configuration_angpt.py` and `modeling_angpt.py` are the
remote code an export ships, so they import nothing of angpt but each other. The rest may import
`angpt.training` (checkpoints, the config adapters) and everything below it.
"""
