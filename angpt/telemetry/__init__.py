"""What a run reports: the log line, progress bar and metrics files (with their reader), anGPT's health
signals, FLOPs, MFU and device memory. It imports `angpt.models` and nothing of `angpt.training`: the
trainer hands it what to report.
"""
