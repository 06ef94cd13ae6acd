"""transformers integration: this project's decoder behind ``model.generate(custom_generate=...)``.

``model.generate(input_ids, custom_generate=taps.hf.custom_generate_path(), trust_remote_code=True,
drafter=..., taps_policy="taps", max_new_tokens=...)`` runs :func:`taps.decode.generate` with
transformers' generation-config conventions (see ``custom_generate/README.md``).
"""
from __future__ import annotations

from pathlib import Path


def custom_generate_path() -> str:
    """The directory to pass as ``custom_generate=``: it holds ``custom_generate/generate.py``, the
    layout transformers expects of a custom decoding method (a local directory needs
    ``trust_remote_code=True``, since transformers executes that file)."""
    return str(Path(__file__).resolve().parent)
