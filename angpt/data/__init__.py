"""Data: raw text corpora, tokenizers, indexed datasets on disk, and the training datasets. It imports
nothing else of angpt, so that the tools of tools/ use it without the model or the trainer.
"""
