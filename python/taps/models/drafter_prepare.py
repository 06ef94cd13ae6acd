"""Readying a loaded drafter for decoding: which body (the GGUF block forward or a float dtype for the
PyTorch layers) and which vocabulary-head dtype run on a device. Proposals only: no choice here changes a
generated token."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from .drafter import DFlashDrafter


def cpu_has_native_bf16() -> bool:
    """True where the CPU has bf16 dot-product instructions (AVX512-BF16 or AMX-BF16, Linux flags)."""
    from taps_kernels.backend import cpu_flags

    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def fast_body_dtype(device) -> Optional[torch.dtype]:
    """The dtype the drafter's layers should run in on ``device`` (``None``: the target's).

    bf16 on CPUs with native bf16 dot products (held-out tau unchanged, ~2.7 ms less per draft on this
    project's CPU, ``checkpoints/smollm2-dflash/README.md``); elsewhere bf16 is emulated and slower. The
    layers stay in floating point: int8 layers cost 2.4% held-out tau for ~1.5 ms.
    """
    dev = torch.device(device)
    return torch.bfloat16 if dev.type == "cpu" and cpu_has_native_bf16() else None


def fast_head_dtype(device) -> Optional[torch.dtype]:
    """The dtype :meth:`DFlashDrafter.draft` should project onto the vocabulary with on ``device``
    (``None``: the LM head's own dtype; ``torch.int8``: :class:`taps_kernels.integrations.int8_linear.Int8Linear`).

    On a CPU the ``D x V`` vocabulary projection is a third or more of a draft pass. The draft logits only
    propose tokens that the target then verifies, so a lower-precision head changes no generated token, at
    most a proposal. int8 where fbgemm runs (``taps_kernels.backend.int8_linear_backend``: 0.4 ms against
    2.3 ms in bf16 for 7 rows x 16K ids here; held-out tau -0.01, tokens per second up on both benchmark
    sets, ``checkpoints/smollm2-dflash/README.md``), else bf16 where the CPU has native bf16 dot products.
    On CUDA the head is used as loaded.
    """
    from taps_kernels.backend import int8_linear_backend

    dev = torch.device(device)
    if dev.type != "cpu":
        return None
    if int8_linear_backend(dev)[0] == "fbgemm":
        return torch.int8
    return torch.bfloat16 if cpu_has_native_bf16() else None


#: Drafter body modes of :func:`prepare_drafter`: ``blocks`` = the GGUF block forward
#: (:mod:`taps.models.drafter_blocks`), or a float dtype for the PyTorch layers.
DRAFT_BODIES = ("auto", "blocks", "float32", "bfloat16", "float16")
DRAFT_HEADS = ("auto", "float32", "bfloat16", "float16", "int8", "q8_0", "q4_1")
#: Head formats of the block body (the rest are the PyTorch layers' head dtypes).
BLOCK_HEADS = ("q8_0", "q4_1")
#: The block body's head when ``head="auto"``.
DEFAULT_BLOCK_HEAD = "q8_0"


def prepare_drafter(drafter: "DFlashDrafter", device, body: str = "auto", head: str = "auto",
                    short_blocks: bool = False) -> "DFlashDrafter":
    """The one place that readies a loaded drafter for decoding on ``device`` (proposals only: no choice here
    changes a generated token).

    ``body``: ``auto`` = ``blocks`` on CPUs where the block forward runs (AVX-512 VNNI or AVX2: the whole draft pass in
    one C++ call, ~2 ms against ~6 ms for bf16 layers here), else :func:`fast_body_dtype` (or the drafter's
    float32); ``head``: for the PyTorch layers ``auto`` = :func:`fast_head_dtype`, or a dtype name / ``int8``; for
    the block body ``auto`` = :data:`DEFAULT_BLOCK_HEAD`, or ``q8_0`` / ``q4_1`` (:func:`enable_block_draft`).
    """
    from .drafter_blocks import block_draft_available, block_draft_unsupported, enable_block_draft

    if body not in DRAFT_BODIES:
        raise ValueError(f"body: expected one of {DRAFT_BODIES}, received {body!r}")
    if head not in DRAFT_HEADS:
        raise ValueError(f"head: expected one of {DRAFT_HEADS}, received {head!r}")
    dev = torch.device(device)
    if body == "auto":
        blocks = dev.type == "cpu" and block_draft_available() and not block_draft_unsupported(drafter.config)
        body = "blocks" if blocks else \
            str(fast_body_dtype(dev) or torch.float32).replace("torch.", "")
    drafter = drafter.to(device=dev, dtype=torch.float32 if body == "blocks" else getattr(torch, body)).eval()
    drafter.short_blocks = bool(short_blocks)
    if (head in BLOCK_HEADS) != (body == "blocks") and head != "auto":
        raise ValueError(f"head: {head!r} does not fit the {body} body (the block body takes {BLOCK_HEADS}, the "
                         f"PyTorch layers a dtype name or int8)")
    if body == "blocks":
        enable_block_draft(drafter, DEFAULT_BLOCK_HEAD if head == "auto" else head)
    else:
        drafter.head_dtype = fast_head_dtype(dev) if head == "auto" else \
            (torch.int8 if head == "int8" else getattr(torch, head))
    return drafter
