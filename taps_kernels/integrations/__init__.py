"""Adapters that plug taps_kernels into model libraries and serving engines.

* :mod:`taps_kernels.integrations.transformers`: the ``"taps_tree"`` attention implementation for
  Hugging Face transformers models (Llama, Qwen3 and other models that dispatch attention through
  ``AttentionInterface``). Import it explicitly; importing this package does not import transformers.
* Engine layouts (pure torch functions, ``docs/ENGINES.md``): :func:`to_eagle_topology` /
  :func:`pack_qlen_only` (:mod:`.sglang_tree`: SGLang's EAGLE verify topology and ``QLEN_ONLY`` mask) and
  :func:`to_sequence_sets` / :func:`batch_entries` (:mod:`.llamacpp_tree`: one llama.cpp sequence per
  root-to-leaf path), both read from our ``ancestor_bits`` (:mod:`.tree_bits`).
"""
from .llamacpp_tree import LLAMA_MAX_SEQ, SequenceSets, batch_entries, to_sequence_sets
from .sglang_tree import EagleTopology, pack_qlen_only, to_eagle_topology

__all__ = ["EagleTopology", "LLAMA_MAX_SEQ", "SequenceSets", "batch_entries", "pack_qlen_only",
           "to_eagle_topology", "to_sequence_sets"]
