"""Many runs at once: the job runner behind tools/sweep.py and benchmarks/convergence.py. It starts
training as subprocesses and reads their metrics (`angpt.telemetry`); it never imports torch.
"""
