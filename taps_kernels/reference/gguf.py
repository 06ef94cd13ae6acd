"""References of the GGUF block kernels (``csrc/gguf_linear.h``), written out in plain PyTorch over the raw
blocks exactly as a GGUF file stores them (not the packed layout the kernel reads).

Block formats (32 elements each):

* Q4_1 (GGML type 3), 20 bytes: fp16 ``d``, fp16 ``m``, 16 bytes ``qs``; element ``j < 16`` is ``qs[j] & 0xF``,
  element ``j + 16`` is ``qs[j] >> 4``; ``w = q * d + m`` (exact in float32).
* Q8_0 (GGML type 8), 34 bytes: fp16 ``d``, 32 int8 ``q``; ``w = q * d``.

The linear layer's numerics (what the kernel must reproduce bit for bit): activations quantised per row
and 32-block (:func:`quantize_activations_reference`), exact integer block sums, then per block, in block
order, ``blk = d * float(sum q*a) [+ m * float(sum a)]`` and ``acc = acc + blk * scale`` in float32 with
separate roundings. With two activation digits the rounding residual of each row is quantised again
(:func:`residual_digits_reference`), its rows run through the same arithmetic, and the two results are added in
float32.
"""
from __future__ import annotations

import torch

Q4_1 = 3
Q8_0 = 8
BLOCK = 32
BLOCK_BYTES = {Q4_1: 20, Q8_0: 34}
TYPE_NAMES = {Q4_1: "Q4_1", Q8_0: "Q8_0"}


def _blocks(raw: torch.Tensor, ggml_type: int, cols: int) -> torch.Tensor:
    """``raw [N, cols/32 * block_bytes] uint8`` -> ``[N, cols/32, block_bytes]``."""
    if ggml_type not in BLOCK_BYTES:
        raise ValueError(f"ggml_type: expected Q4_1 (3) or Q8_0 (8), received {ggml_type}")
    if cols % BLOCK:
        raise ValueError(f"cols: expected a multiple of {BLOCK}, received {cols}")
    return raw.reshape(raw.shape[0], cols // BLOCK, BLOCK_BYTES[ggml_type])


def _half(b: torch.Tensor) -> torch.Tensor:
    """Two uint8 columns (little-endian) -> their float16 value as float32."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def block_codes_reference(raw: torch.Tensor, ggml_type: int, cols: int):
    """``(q [N, cols] int64, d [N, cols/32] float32, m [N, cols/32] float32 or None)`` of GGUF rows."""
    blk = _blocks(raw, ggml_type, cols)
    d = _half(blk[..., 0:2])
    if ggml_type == Q4_1:
        m = _half(blk[..., 2:4])
        qs = blk[..., 4:20].to(torch.int64)
        q = torch.cat([qs & 0xF, qs >> 4], dim=-1)  # [N, KB, 32]: elements 0..15 low nibbles, 16..31 high
        return q.reshape(raw.shape[0], cols), d, m
    q = blk[..., 2:34].contiguous().view(torch.int8).to(torch.int64)
    return q.reshape(raw.shape[0], cols), d, None


def dequantize_blocks_reference(raw: torch.Tensor, ggml_type: int, cols: int) -> torch.Tensor:
    """Exact float32 weights ``[N, cols]`` of GGUF rows ``raw [N, cols/32 * block_bytes] uint8``."""
    q, d, m = block_codes_reference(raw, ggml_type, cols)
    w = q.float().view(q.shape[0], -1, BLOCK) * d[..., None]
    if m is not None:
        w = w + m[..., None]
    return w.reshape(q.shape[0], cols)


def quantize_activations_reference(x: torch.Tensor):
    """``x [M, K] float32`` -> ``(a [M, K] int8, scale [M, K/32] float32, asum [M, K/32] int32)``.

    Per row and 32-block: ``amax = max|x|``, ``scale = amax / 127``, ``a = round_half_even(x * (127 / amax))``
    (``a = 0``, ``scale = 0`` where ``amax = 0``); a block holding inf or NaN gets ``a = 0``, ``scale = NaN``.
    """
    M, K = x.shape
    xb = x.float().reshape(M, K // BLOCK, BLOCK)
    amax = xb.abs().amax(dim=-1)
    bad = ~torch.isfinite(xb).all(dim=-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    a = torch.round(xb * inv[..., None]).clamp(-127, 127)
    a = torch.where(bad[..., None], torch.zeros_like(a), a).to(torch.int8)
    scale = torch.where(bad, torch.full_like(amax, float("nan")), amax / torch.tensor(127.0))
    return a.reshape(M, K), scale, a.to(torch.int32).sum(dim=-1, dtype=torch.int32)


#: The residual digit's steps per step of the leading one, and the levels of both: ``scale_lo = amax / 32258``.
RESIDUAL_STEPS = 254.0
TWO_DIGIT_LEVELS = 127.0 * RESIDUAL_STEPS


def residual_digits_reference(x: torch.Tensor, a: torch.Tensor, scale: torch.Tensor):
    """The second activation digit of ``x [M, K] float32`` already quantised to ``(a, scale)`` by
    :func:`quantize_activations_reference` -> ``(lo [M, K] int8, scale_lo [M, K/32] float32, losum [M, K/32]
    int32)``.

    ``lo = round_half_even((x * (127 / amax) - a) * 254)`` in [-127, 127] (the float32 product that rounded to
    ``a``; its difference to ``a`` is exact), ``scale_lo = amax / 32258``; where ``scale`` is NaN (inf or NaN in the
    block) ``lo = 0`` and ``scale_lo = NaN``. So ``x ~ a * scale + lo * scale_lo`` to ~15 bits of ``amax``.
    """
    M, K = x.shape
    xb = x.float().reshape(M, K // BLOCK, BLOCK)
    bad = torch.isnan(scale)
    amax = torch.where(bad, torch.zeros_like(scale), xb.abs().amax(dim=-1))
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    r = torch.where(bad[..., None], torch.zeros_like(xb), xb * inv[..., None] - a.reshape(M, K // BLOCK, BLOCK).float())
    lo = torch.round(r * RESIDUAL_STEPS).clamp(-127, 127).to(torch.int8)
    scale_lo = torch.where(bad, scale, amax / torch.tensor(TWO_DIGIT_LEVELS))
    return lo.reshape(M, K), scale_lo, lo.to(torch.int32).sum(dim=-1, dtype=torch.int32)


def quantize_activations_digits_reference(x: torch.Tensor, digits: int):
    """``digits`` (1 or 2) rows of activations per row of ``x [M, K]``: ``(a [D*M, K] int8, scale [D*M, K/32],
    asum [D*M, K/32] int32)``, the leading digits of the M rows, then (two digits) their residual digits."""
    if digits not in (1, 2):
        raise ValueError(f"activation_digits: expected 1 or 2, received {digits}")
    a, scale, asum = quantize_activations_reference(x)
    if digits == 1:
        return a, scale, asum
    lo, scale_lo, losum = residual_digits_reference(x, a, scale)
    return torch.cat([a, lo]), torch.cat([scale, scale_lo]), torch.cat([asum, losum])


def gguf_linear_reference(x: torch.Tensor, raw: torch.Tensor, ggml_type: int,
                          activation_digits: int = 1) -> torch.Tensor:
    """``x [M, K] float32`` times GGUF rows ``raw [N, K/32 * block_bytes] uint8`` transposed -> ``[M, N]``
    float32, with the kernel's numerics (module docstring) for ``activation_digits`` 1 or 2, bit for bit."""
    M, K = x.shape
    q, d, m = block_codes_reference(raw, ggml_type, K)
    a, scale, asum = quantize_activations_digits_reference(x, activation_digits)
    acc = torch.zeros(a.shape[0], raw.shape[0], dtype=torch.float32)
    for kb in range(K // BLOCK):
        cols = slice(kb * BLOCK, (kb + 1) * BLOCK)
        # integer block sums, exact in float64 (|sum| < 2**20)
        isum = (a[:, cols].double() @ q[:, cols].double().T).float()
        blk = d[None, :, kb] * isum
        if m is not None:
            blk = blk + m[None, :, kb] * asum[:, kb, None].float()
        acc = acc + blk * scale[:, kb, None]
    return acc if activation_digits == 1 else acc[:M] + acc[M:]


def quantize_q8_0_reference(weight: torch.Tensor) -> torch.Tensor:
    """Float rows ``[N, K]`` (``K`` a multiple of 32) -> Q8_0 GGUF rows ``[N, K/32 * 34] uint8``, as llama.cpp
    quantises: per block ``d = fp16(max|w| / 127)``, ``q = round_half_even(w / d)`` clamped to [-127, 127]
    (``q = 0`` where ``d = 0``)."""
    N, K = weight.shape
    if K % BLOCK:
        raise ValueError(f"weight: expected a multiple of {BLOCK} columns, received {K}")
    w = weight.detach().float().reshape(N, K // BLOCK, BLOCK)
    d = (w.abs().amax(-1) / 127).to(torch.float16)
    df = d.float()
    q = torch.where(df[..., None] > 0, torch.round(w / df[..., None].clamp(min=torch.finfo(torch.float32).tiny)),
                    torch.zeros_like(w)).clamp(-127, 127).to(torch.int8)
    blk = torch.cat([d[..., None].view(torch.uint8).reshape(N, K // BLOCK, 2), q.view(torch.uint8)], dim=-1)
    return blk.reshape(N, -1).contiguous()


def quantize_q4_1_reference(weight: torch.Tensor) -> torch.Tensor:
    """Float rows ``[N, K]`` (``K`` a multiple of 32) -> Q4_1 GGUF rows ``[N, K/32 * 20] uint8``: per block
    ``m = fp16(min w)``, ``d = fp16((max w - min w) / 15)``, ``q = round_half_even((w - m) / d)`` clamped to [0, 15]
    (``q = 0`` where ``d = 0``)."""
    N, K = weight.shape
    if K % BLOCK:
        raise ValueError(f"weight: expected a multiple of {BLOCK} columns, received {K}")
    w = weight.detach().float().reshape(N, K // BLOCK, BLOCK)
    lo, hi = w.amin(-1), w.amax(-1)
    d, m = ((hi - lo) / 15).to(torch.float16), lo.to(torch.float16)
    df, mf = d.float()[..., None], m.float()[..., None]
    q = torch.where(df > 0, torch.round((w - mf) / df.clamp(min=torch.finfo(torch.float32).tiny)),
                    torch.zeros_like(w)).clamp(0, 15).to(torch.uint8)
    qs = q[..., :16] | (q[..., 16:] << 4)
    blk = torch.cat([d[..., None].view(torch.uint8).reshape(N, K // BLOCK, 2),
                     m[..., None].view(torch.uint8).reshape(N, K // BLOCK, 2), qs], dim=-1)
    return blk.reshape(N, -1).contiguous()
