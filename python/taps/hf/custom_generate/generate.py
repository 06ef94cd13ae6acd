"""``generate(model, ...)``: transformers' ``custom_generate`` entry point for this project's decoder.

transformers calls ``generate(model=model, inputs=..., generation_config=..., streamer=..., **kwargs)`` with
every argument of ``model.generate`` (see ``README.md`` beside this file). The call is translated to
:func:`taps.decode.generate` (batch 1, one row after another): EOS, ``max_new_tokens`` / ``max_length`` and
sampling settings come from the generation config merged with the call's arguments, the policy from
``taps_policy``, the drafter from ``drafter``.

Output: ``[B, T + new] int64`` sequences (prompt first, rows that stop early right-padded with
``pad_token_id``), or ``GenerateDecoderOnlyOutput(sequences=...)`` with ``return_dict_in_generate``.
"""
from __future__ import annotations

from typing import List, Optional

import torch

#: Generation-config fields whose non-default values this method cannot honour: (field, default values).
UNSUPPORTED = (("num_beams", (None, 1)), ("num_return_sequences", (None, 1)), ("repetition_penalty", (None, 1.0)),
               ("no_repeat_ngram_size", (None, 0)), ("min_new_tokens", (None, 0)), ("min_length", (None, 0)),
               ("bad_words_ids", (None,)), ("suppress_tokens", (None,)), ("begin_suppress_tokens", (None,)),
               ("min_p", (None,)), ("typical_p", (None, 1.0)), ("epsilon_cutoff", (None, 0.0)),
               ("eta_cutoff", (None, 0.0)), ("guidance_scale", (None, 1.0)), ("forced_bos_token_id", (None,)),
               ("forced_eos_token_id", (None,)))

#: ``model.generate`` arguments this method cannot honour when set.
UNSUPPORTED_ARGS = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "assistant_model",
                    "negative_prompt_ids", "negative_prompt_attention_mask")


def _eos_ids(value) -> List[int]:
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [int(t) for t in value.reshape(-1).tolist()]
    if isinstance(value, (list, tuple)):
        return [int(t) for t in value]
    return [int(value)]


def _load_drafter(drafter, model):
    """A DFlashDrafter on the target's device and dtype, from an instance, a directory or the shipped one."""
    from taps import paths
    from taps.models.drafter import DFlashDrafter, check_compatible, load_decoding_drafter

    if drafter is None:
        drafter = paths.checkpoint_dir(paths.DRAFTER)
    if isinstance(drafter, DFlashDrafter):  # the caller's own instance, used as it is
        check_compatible(drafter.config, model.config)
        return drafter
    emb = model.get_input_embeddings().weight
    # on CPUs the fastest draft path (the block forward where it runs); elsewhere the target's dtype
    body = "auto" if emb.device.type == "cpu" else str(emb.dtype).replace("torch.", "")
    return load_decoding_drafter(paths.resolve_checkpoint(drafter), model, body=body)


def generate(model, inputs: Optional[torch.Tensor] = None, generation_config=None, streamer=None, drafter=None,
             taps_policy: str = "taps-lookup", taps_seed: Optional[int] = None, taps_scorer=None,
             taps_pool_size: Optional[int] = None, **kwargs):
    """Run this project's lossless speculative decoder for every row of ``inputs`` ``[B, T] int64``.

    ``drafter``: a ``DFlashDrafter``, a drafter directory, or None (the shipped drafter, when the policy
    drafts). ``taps_policy``: a policy spec (``ar``, ``dflash``, ``ddtree:8``, ``taps``, ``taps-lookup``, ...).
    ``taps_seed``: seed of the target's draws when sampling (default: drawn from torch's generator).
    ``taps_scorer`` / ``taps_pool_size``: the taps* policies' scorer directory and pool size (default: the
    shipped scorer, 128); ignored by policies without them.
    """
    from taps.decode import SamplingConfig
    from taps.decode import generate as taps_generate
    from taps.decode.policies import make_policy, policy_options

    def _policy():
        options = {"scorer": taps_scorer, "pool_size": taps_pool_size}
        return make_policy(taps_policy, **{k: v for k, v in options.items() if k in policy_options(taps_policy)})

    input_ids = kwargs.pop("input_ids", None) if inputs is None else inputs
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"inputs: expected a [B, T] int64 tensor of token ids, received "
                         f"{type(input_ids).__name__}{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else ''}")
    for name in UNSUPPORTED_ARGS:
        value = kwargs.pop(name, None)
        if value is not None and not (hasattr(value, "__len__") and len(value) == 0):
            raise ValueError(f"{name}: not supported by the taps custom_generate method (received {value!r})")
    for name in ("synced_gpus", "use_model_defaults", "custom_generate", "trust_remote_code", "use_cache"):
        kwargs.pop(name, None)
    attention_mask = kwargs.pop("attention_mask", None)
    return_dict = kwargs.pop("return_dict_in_generate", None)
    gc, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    if return_dict is None:
        return_dict = bool(getattr(gc, "return_dict_in_generate", False))
    for name, defaults in UNSUPPORTED:
        value = getattr(gc, name, None)
        if value not in defaults:
            raise ValueError(f"{name}: not supported by the taps custom_generate method (received {value!r})")
    leftover = {k: v for k, v in model_kwargs.items() if v is not None}
    if leftover:
        raise ValueError(f"unknown generate arguments for the taps custom_generate method: {sorted(leftover)}")

    B, T = input_ids.shape
    if gc.max_new_tokens is not None:
        max_new = int(gc.max_new_tokens)
    else:
        max_new = int(gc.max_length) - T
    if max_new < 1:
        raise ValueError(f"max_new_tokens: expected >= 1 new token, received {max_new} "
                         f"(max_length {gc.max_length}, prompt length {T})")
    if gc.do_sample:
        sampling = SamplingConfig(temperature=float(gc.temperature if gc.temperature is not None else 1.0),
                                  top_k=int(gc.top_k or 0), top_p=float(gc.top_p if gc.top_p is not None else 1.0))
    else:
        sampling = SamplingConfig()
    stops = _eos_ids(gc.eos_token_id)
    pad = gc.pad_token_id if gc.pad_token_id is not None else (stops[0] if stops else 0)
    pad = _eos_ids(pad)[0]

    policy = _policy()
    draft_model = _load_drafter(drafter, model) if policy.uses_drafter else None
    if streamer is not None:
        streamer.put(input_ids.cpu())
    rows = []
    for b in range(B):
        ids = input_ids[b]
        if attention_mask is not None:
            ids = ids[attention_mask[b].to(torch.bool)]
        seed = taps_seed if taps_seed is not None else (
            int(torch.randint(0, 2**31 - 1, (1,))) if not sampling.greedy else 0)
        if b > 0:
            policy = _policy()  # a policy keeps per-generation state (gate, overhead)
        res = taps_generate(model, ids.tolist(), policy, drafter=draft_model, max_new_tokens=max_new,
                            sampling=sampling, stop_token_ids=stops, seed=seed)
        rows.append(res.token_ids)
        if streamer is not None and res.token_ids:
            streamer.put(torch.tensor(res.token_ids, dtype=torch.long))
    if streamer is not None:
        streamer.end()
    width = max(len(r) for r in rows)
    new = torch.full((B, width), pad, dtype=torch.long)
    for b, r in enumerate(rows):
        new[b, :len(r)] = torch.tensor(r, dtype=torch.long)
    sequences = torch.cat([input_ids.cpu().long(), new], dim=1).to(input_ids.device)
    if return_dict:
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences
