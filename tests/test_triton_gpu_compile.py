"""Compile every Triton kernel for sm_90 on a machine without a GPU (Triton -> PTX -> ptxas -> cubin).

The interpreter accepts shapes a GPU rejects (``tl.dot`` dims under 16, oversized shared memory);
this catches them on CPU-only CI. The compile runs in a subprocess because kernels imported under
``TRITON_INTERPRET=1`` (set by conftest) are interpreter objects. Slow (~1-2 minutes): the fp32
IEEE attention variants take ~15 s each in ptxas.
"""
import os
import subprocess
import sys

import pytest

H100_SMEM = 227 * 1024  # per-block shared memory limit on sm_90 (bytes)


def _configs():
    import torch
    from taps_kernels.triton import edge_score as S
    from taps_kernels.triton import topk_stats as T
    from taps_kernels.triton import tree_attention as A

    out = []
    for dt in ("*bf16", "*fp16", "*fp32"):
        out.append((T._topk_partial_kernel, {"logits_ptr": dt, "part_keys_ptr": "*i64"},
                    dict(KSEL=64, KSEL_PAD=64, BLOCK_V=1024), (), 4))
    out.append((T._topk_partial_kernel, {"part_keys_ptr": "*i64"}, dict(KSEL=2, KSEL_PAD=2, BLOCK_V=16), (), 4))
    for ksel, kpad, spad, second in ((64, 64, 16, True), (1, 2, 2, False)):
        out.append((T._topk_merge_kernel, {"part_keys_ptr": "*i64", "topk_ids_ptr": "*i64"},
                    dict(KSEL=ksel, KSEL_PAD=kpad, S_PAD=spad, HAS_SECOND=second), (), 4))
    dtypes = {"*bf16": torch.bfloat16, "*fp16": torch.float16, "*fp32": torch.float32}
    for dt, tdt in dtypes.items():
        for group, head_dim, rows in ((4, 128, 1024), (1, 64, 1), (4, 80, 1024)):
            bm, bn, bd = A._block_sizes(rows, head_dim, tdt)
            ptrs = {"q_ptr": dt, "k_ptr": dt, "v_ptr": dt, "out_ptr": dt, "bits_ptr": "*i32", "plen_ptr": "*i64"}
            out.append((A._tree_attention_kernel, ptrs, dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_M=bm, BLOCK_N=bn,
                                                             BLOCK_D=bd, IEEE=tdt == torch.float32),
                        ("qk_scale",), 4 if bd <= 64 else 8))
    pe = {"tokens_ptr": "*i64", "parents_ptr": "*i32", "depth_ptr": "*i32", "emb_ptr": "*bf16", "hid_ptr": "*bf16"}
    out.append((S._edge_logits_kernel, pe, dict(PT=32, PT_PAD=32, PD=8, PD_PAD=16, PH=32, PH_PAD=32, F=111, M=64,
                                                M_PAD=64, FULL=True, BLOCK_R=16, BLOCK_K=64), ("eps",), 4))
    out.append((S._edge_logits_kernel, pe, dict(PT=1, PT_PAD=16, PD=1, PD_PAD=16, PH=1, PH_PAD=16, F=7, M=32,
                                                M_PAD=32, FULL=False, BLOCK_R=16, BLOCK_K=64), ("eps",), 4))
    for normalise in (True, False):
        out.append((S._normalise_propagate_kernel, {"parents_ptr": "*i32", "depth_ptr": "*i32", "seg_sum_ptr": "*i64"},
                    dict(NORMALISE=normalise, BLOCK=128), (), 4))
    return out


def compile_all() -> int:
    """Compile every config; print one line each; return the number of failures."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    failures = 0
    for kernel, ptr_types, constexprs, floats, warps in _configs():
        sig = {}
        for name in kernel.arg_names:
            if name in constexprs:
                sig[name] = "constexpr"
            elif name.endswith("_ptr"):
                sig[name] = ptr_types.get(name, "*fp32")
            else:
                sig[name] = "fp32" if name in floats else "i32"
        try:
            k = triton.compile(ASTSource(kernel, sig, constexprs), target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": warps})
            smem = k.metadata.shared
            status = "ok" if smem <= H100_SMEM else "FAIL shared memory"
            failures += status != "ok"
            print(f"{status} {kernel.__name__} {constexprs} shared={smem}", flush=True)
        except Exception as exc:  # report every failing config, not just the first
            failures += 1
            print(f"FAIL {kernel.__name__} {constexprs}: {type(exc).__name__}: {str(exc)[:1500]}", flush=True)
    return failures


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90():
    pytest.importorskip("triton")
    try:
        from triton.backends.nvidia import compiler  # noqa: F401
    except Exception as exc:
        pytest.skip(f"triton has no NVIDIA backend here: {exc}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, cwd=root, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, f"sm_90 compile failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    sys.exit(1 if compile_all() else 0)
