"""The error of the Hugging Face export and import: a checkpoint or model directory that cannot be converted."""


class ExportError(ValueError):
    """A checkpoint that cannot be exported (or a model directory that cannot be imported); the message says why."""
