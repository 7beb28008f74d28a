"""The nvfp4_group_gemm library's entry as a harness submission: the same contract as
submission.py, on every GPU the library runs (B200 sm_100a, H100/H200 sm_90a), launched on
the caller's current stream. `python eval.py test` picks it on an H100/H200; the official
harness runs it with the repository root on PYTHONPATH."""

from nvfp4_group_gemm import custom_kernel

__all__ = ["custom_kernel"]
