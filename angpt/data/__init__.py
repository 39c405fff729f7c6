"""Data: raw text corpora, tokenizers, indexed datasets on disk, and the training datasets."""
