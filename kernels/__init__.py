"""Pagoda kernels: Triton kernels, torch reference ops with the same signatures, dispatch.

Kept cheap and side-effect free on import: transformers probes an import name `kernels`
(a Hugging Face library of that name), and this package must not look like it.
"""

__version__ = "0.1.0"
