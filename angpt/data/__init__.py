"""Data: raw text corpora, tokenizers, indexed datasets on disk, and the training datasets. It imports only the
configuration (its data section, the blend syntax), so that the tools of tools/ use it without the model or the
trainer.
"""
