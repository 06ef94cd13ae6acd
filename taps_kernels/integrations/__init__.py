"""Adapters that plug taps_kernels into model libraries.

* :mod:`taps_kernels.integrations.transformers`: the ``"taps_tree"`` attention implementation for
  Hugging Face transformers models (Llama, Qwen3 and other models that dispatch attention through
  ``AttentionInterface``). Import it explicitly; importing this package does not import transformers.
"""
