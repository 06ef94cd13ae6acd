"""The plain-CUDA bookkeeping kernels (csrc/cuda): compile-only check here, equality with the references on a GPU.

* ``test_nvcc_*``: nvcc compiles csrc/cuda/tree_kernels.cu for sm_90 with warnings as errors, without
  torch headers (skipped when nvcc is missing). Runs on CPU-only machines.
* ``@pytest.mark.gpu`` tests need a CUDA device and the ``taps_kernels._C_cuda`` extension; they are
  skipped otherwise, unless ``TAPS_REQUIRE_CUDA_EXT=1`` (set by bench/gpu_check.sh) turns a missing
  extension on a GPU machine into a failure. Discrete outputs must match the references exactly.
"""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from helpers import random_tree
from taps_kernels import backend
from taps_kernels.reference import accept_greedy_reference, compact_kv_reference, tree_mask_reference

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "csrc" / "cuda" / "tree_kernels.cu"


def _nvcc():
    found = shutil.which("nvcc")
    if found is None and os.environ.get("CUDA_HOME"):
        candidate = Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc"
        found = str(candidate) if candidate.exists() else None
    return found


def test_tree_kernels_include_no_torch_headers():
    """tree_kernels.{cu,cuh} must stay compilable by nvcc alone (the CMake object library builds them)."""
    for path in (KERNELS, KERNELS.with_suffix(".cuh")):
        includes = re.findall(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', path.read_text(), flags=re.M)
        foreign = [h for h in includes if re.match(r"(torch|ATen|c10|pybind11|Python)", h)]
        assert not foreign, f"{path.name} includes {foreign}"


def test_nvcc_compiles_tree_kernels_sm90(tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (PATH or CUDA_HOME): the CUDA kernels cannot be compile-checked here")
    cmd = [nvcc, "-std=c++17", "-O3", "-arch=sm_90", "-Werror", "all-warnings", "-Xcompiler", "-Wall,-Wextra,-Werror",
           "-c", str(KERNELS), "-o", str(tmp_path / "tree_kernels.o")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stdout}\n{res.stderr}"
    assert (tmp_path / "tree_kernels.o").stat().st_size > 0


# --- CPU emulation of the kernels ------------------------------------------------------------------------------
# CPU-only machines cannot run the kernels, but they can run the same source: tree_kernels.cu is
# compiled by g++ against a tiny shim (one std::thread per CUDA thread, a std::barrier per block for
# __syncthreads, blocks one after another, __shared__ as a static shared by the block's threads).
# This checks the kernels' logic (bit packing, the block-wide walk, the chunked in-place gather)
# against the references; it does not check GPU memory ordering across blocks (the gpu tests do).

_SHIM = r"""
#pragma once
#include <atomic>
#include <barrier>
#include <cstdint>
#include <thread>
#include <vector>
struct dim3 { unsigned x, y, z; dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {} };
struct uint3 { unsigned x, y, z; };
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
inline thread_local uint3 threadIdx, blockIdx;
inline thread_local dim3 blockDim, gridDim;
inline thread_local std::barrier<>* emu_barrier = nullptr;
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
typedef int cudaError_t;
enum { cudaSuccess = 0, cudaErrorInvalidValue = 1 };
typedef void* cudaStream_t;
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
template <class T> inline T __ldg(const T* p) { return *p; }
inline void __syncthreads() { emu_barrier->arrive_and_wait(); }
inline int atomicMin(int* a, int v) {
  std::atomic_ref<int> r(*a);
  int old = r.load();
  while (v < old && !r.compare_exchange_weak(old, v)) {}
  return old;
}
using std::min;
template <class K, class... A> void emu_launch(K kernel, dim3 grid, dim3 block, A... args) {
  const unsigned nt = block.x * block.y * block.z;
  for (unsigned z = 0; z < grid.z; ++z) for (unsigned y = 0; y < grid.y; ++y) for (unsigned x = 0; x < grid.x; ++x) {
    std::barrier<> bar(nt);
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < nt; ++t) threads.emplace_back([&, t] {
      threadIdx = {t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
      blockIdx = {x, y, z}; blockDim = block; gridDim = grid; emu_barrier = &bar;
      kernel(args...);
      bar.arrive_and_drop();  // a thread that returned early no longer takes part in barriers
    });
    for (auto& th : threads) th.join();
  }
}
"""

_EXPORTS = r"""
extern "C" {
int emu_tree_mask(const int32_t* p, const int32_t* d, const int32_t* n, const int64_t* pl, int64_t B, int64_t N,
                  int64_t* pos, int32_t* bits) {
  return taps::cuda::launch_tree_mask(p, d, n, pl, B, N, pos, bits, nullptr);
}
int emu_accept(const int64_t* t, const int32_t* p, const int32_t* n, const int64_t* tg, int64_t B, int64_t N,
               int64_t P, int64_t* path, int64_t* len, int64_t* next) {
  return taps::cuda::launch_accept_greedy(t, p, n, tg, B, N, P, path, len, next, nullptr);
}
int emu_compact(const int64_t* table, int64_t T, int64_t B, int64_t L, int64_t heads, int64_t units, int unit,
                const int64_t* pl, const int64_t* path, int64_t P) {
  return taps::cuda::launch_compact_kv(table, T, B, L, heads, units, unit, pl, path, P, nullptr);
}
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """The kernels of tree_kernels.cu built for the CPU shim; returns a ctypes library."""
    import ctypes

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler for the CPU emulation of the CUDA kernels")
    d = tmp_path_factory.mktemp("emu")
    (d / "shim.h").write_text(_SHIM)
    (d / "cuda_runtime.h").write_text("#pragma once\n")
    src = KERNELS.read_text().replace('#include "tree_kernels.cuh"', f'#include "{KERNELS.with_suffix(".cuh")}"')
    src, launches = re.subn(r"([A-Za-z_]+(?:<[A-Za-z_]+>)?)<<<([^,]+),\s*([^,]+),\s*[^,]+,\s*[^>]+>>>\(",
                            r"emu_launch(\1, \2, \3, ", src)
    assert launches == 3, f"expected 3 kernel launches in {KERNELS.name} to rewrite, found {launches}"
    (d / "emu.cpp").write_text(src + _EXPORTS)
    cmd = [cxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-include", str(d / "shim.h"), f"-I{d}",
           str(d / "emu.cpp"), "-o", str(d / "libemu.so")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if res.returncode != 0 and "barrier" in res.stderr:
        pytest.skip(f"{cxx} lacks C++20 <barrier>: {res.stderr[-300:]}")
    assert res.returncode == 0, res.stderr[-2000:]
    return ctypes.CDLL(str(d / "libemu.so"))


def _ptr(t):
    import ctypes

    return ctypes.c_void_p(t.data_ptr())


def test_emulated_tree_mask_and_accept_match_reference(emulated):
    import ctypes

    i64 = ctypes.c_int64
    for N, shape in [(1, "random"), (33, "random"), (97, "random"), (70, "chain"), (40, "star")]:
        tree = _tree(3, N, vocab=3, seed=N, shape=shape)
        prefix_lens = torch.tensor([0, 5, 1 << 33], dtype=torch.int64)
        B = tree.batch_size
        pos = torch.empty(B, N, dtype=torch.int64)
        bits = torch.full((B, N, (N + 31) // 32), 0x5A5A, dtype=torch.int32)  # garbage: every word must be written
        assert emulated.emu_tree_mask(_ptr(tree.parents), _ptr(tree.depth), _ptr(tree.num_nodes), _ptr(prefix_lens),
                                      i64(B), i64(N), _ptr(pos), _ptr(bits)) == 0
        want_pos, want_bits = tree_mask_reference(tree.parents, tree.depth, tree.num_nodes, prefix_lens)
        assert torch.equal(pos, want_pos) and torch.equal(bits, want_bits), (N, shape)

        target = _walking_target(tree, seed=N)
        for path_len in sorted({1, 2, int(tree.depth.max()) + 1}):
            path = torch.full((B, path_len), 99, dtype=torch.int64)
            got = (path, torch.empty(B, dtype=torch.int64), torch.empty(B, dtype=torch.int64))
            assert emulated.emu_accept(_ptr(tree.tokens), _ptr(tree.parents), _ptr(tree.num_nodes), _ptr(target),
                                       i64(B), i64(N), i64(path_len), *(_ptr(t) for t in got)) == 0
            want = accept_greedy_reference(tree.tokens, tree.parents, tree.num_nodes, target, path_len)
            for name, g, w in zip(("path", "accept_len", "next_token"), got, want):
                assert torch.equal(g, w), f"{name}: N={N} {shape} path_len={path_len}"


@pytest.mark.parametrize("dtype,Dh", [(torch.float32, 59), (torch.float16, 8), (torch.bfloat16, 59)])
def test_emulated_compact_kv_matches_reference(emulated, dtype, Dh):
    """Runs the cuda backend's own table builder (taps_kernels.cuda_impls) against the emulated kernel."""
    import ctypes
    import importlib
    import sys
    import types

    fake = types.ModuleType("taps_kernels._C_cuda")
    i64 = ctypes.c_int64

    def compact(table, B, L, heads, units, unit, prefix_lens, path):
        assert emulated.emu_compact(_ptr(table), i64(table.shape[0]), i64(B), i64(L), i64(heads), i64(units),
                                    ctypes.c_int(unit), _ptr(prefix_lens), _ptr(path), i64(path.shape[1])) == 0

    fake.compact_kv, fake.COMPACT_NUM_FIELDS = compact, 6
    saved = {k: sys.modules.get(k) for k in ("taps_kernels._C_cuda", "taps_kernels.cuda_impls")}
    saved_cache = dict(backend._EXT_CACHE)
    backend._EXT_CACHE.pop("_C_cuda", None)
    sys.modules["taps_kernels._C_cuda"] = fake
    sys.modules.pop("taps_kernels.cuda_impls", None)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)  # CPU-only torch cannot pin
            mp.setattr(backend, "_IMPLS", dict(backend._IMPLS))  # the re-import registers a fake "cuda" backend
            cuda_impls = importlib.import_module("taps_kernels.cuda_impls")
            B, N, P, L_used = 3, 64, 24, 160
            prefix_lens = torch.tensor([0, 37, 96], dtype=torch.int64)
            g = torch.Generator().manual_seed(Dh)
            keys = [torch.randn(B, h, 192, Dh, generator=g).to(dtype)[:, :, :L_used] for h in (2, 3)]
            values = [t.clone() * 2 for t in keys]
            path = _random_paths(B, N, P, seed=Dh, prefix_lens=prefix_lens, L=L_used)
            ref_k, ref_v = [t.clone() for t in keys], [t.clone() for t in values]
            want = compact_kv_reference(ref_k, ref_v, prefix_lens, path)
            got = cuda_impls.compact_kv_cuda(keys, values, prefix_lens, path)
    finally:
        for k, v in saved.items():
            sys.modules.pop(k, None)
            if v is not None:
                sys.modules[k] = v
        backend._EXT_CACHE.clear()
        backend._EXT_CACHE.update(saved_cache)
    assert torch.equal(got, want)
    for i, (g_t, w_t) in enumerate(zip(keys + values, ref_k + ref_v)):
        assert torch.equal(g_t, w_t), f"cache tensor {i} differs"


# --- GPU tests ----------------------------------------------------------------------------------------------------

def _cuda_ext_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    mod, why = backend.load_extension("_C_cuda")
    if mod is None:
        if os.environ.get("TAPS_REQUIRE_CUDA_EXT") == "1":
            pytest.fail(f"TAPS_REQUIRE_CUDA_EXT=1 but the CUDA extension is missing: {why}")
        pytest.skip(why)
    return mod


def _tree(B, N, vocab, seed, shape="random"):
    """Batch of trees on the host. ``shape``: random (parents among the 4 latest or any earlier node) / chain
    (deepest) / star (widest); rows after the first get fewer real nodes (padding)."""
    return random_tree(seed, B, N, vocab=vocab, parents={"random": "mixed"}.get(shape, shape), window=4)


def _walking_target(tree, seed):
    """Target tokens that usually continue into some child (long accepted paths), sometimes into none."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(1000, 1010, tree.tokens.shape, generator=g)  # tokens no child carries
    B, N = tree.tokens.shape
    for b in range(B):
        children = [[] for _ in range(N)]
        for j in range(1, int(tree.num_nodes[b])):
            children[int(tree.parents[b, j])].append(j)
        for i, kids in enumerate(children):
            if kids and int(torch.randint(8, (1,), generator=g)) > 0:
                target[b, i] = tree.tokens[b, kids[int(torch.randint(len(kids), (1,), generator=g))]]
    return target


SIZES = [1, 2, 31, 32, 33, 97, 300, 1100]


@pytest.mark.gpu
@pytest.mark.parametrize("N", SIZES)
@pytest.mark.parametrize("shape", ["random", "chain", "star"])
def test_tree_mask_matches_reference(N, shape):
    mod = _cuda_ext_or_skip()
    tree = _tree(3, N, vocab=7, seed=N, shape=shape)
    prefix_lens = torch.tensor([0, 5, 1 << 33], dtype=torch.int64)
    want_pos, want_bits = tree_mask_reference(tree.parents, tree.depth, tree.num_nodes, prefix_lens)
    dev = tree.to("cuda")
    pos, bits = mod.tree_mask(dev.parents, dev.depth, dev.num_nodes, prefix_lens.cuda())
    assert torch.equal(pos.cpu(), want_pos)
    assert torch.equal(bits.cpu(), want_bits)


@pytest.mark.gpu
@pytest.mark.parametrize("N", SIZES)
@pytest.mark.parametrize("shape", ["random", "chain", "star"])
def test_accept_greedy_matches_reference(N, shape):
    mod = _cuda_ext_or_skip()
    # vocab 3: many siblings share a token, so the smallest-index rule decides.
    tree = _tree(4, N, vocab=3, seed=N + 1, shape=shape)
    target = _walking_target(tree, seed=N)
    dev, tgt = tree.to("cuda"), target.cuda()
    max_depth = int(tree.depth.max())
    for path_len in sorted({1, 2, max_depth + 1, max_depth + 5}):
        want = accept_greedy_reference(tree.tokens, tree.parents, tree.num_nodes, target, path_len)
        got = mod.accept_greedy(dev.tokens, dev.parents, dev.num_nodes, tgt, path_len)
        for name, g, w in zip(("path", "accept_len", "next_token"), got, want):
            assert torch.equal(g.cpu(), w), f"{name} differs for path_len={path_len}"


def _random_paths(B, N, P, seed, prefix_lens, L):
    """Strictly increasing root-first paths with heavy overlap between sources and destinations."""
    g = torch.Generator().manual_seed(seed)
    path = torch.full((B, P), -1, dtype=torch.int64)
    for b in range(B):
        room = min(N, L - int(prefix_lens[b]))
        n = int(torch.randint(1, min(P, room) + 1, (1,), generator=g))
        rest = torch.randperm(room - 1, generator=g)[: n - 1] + 1
        path[b, :n] = torch.cat([torch.zeros(1, dtype=torch.int64), rest.sort().values])
    return path


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("Dh", [8, 59, 128])
def test_compact_kv_matches_reference(dtype, Dh):
    mod = _cuda_ext_or_skip()  # noqa: F841  (the cuda backend wraps it)
    from taps_kernels.cuda_impls import compact_kv_cuda

    B, N, P, L_used, L_alloc = 3, 64, 24, 160, 192
    prefix_lens = torch.tensor([0, 37, 96], dtype=torch.int64)
    g = torch.Generator().manual_seed(Dh)
    layers = []
    for heads in (2, 3, 8):
        # A view of a longer buffer (static-cache style): strides are not those of a contiguous tensor.
        buf = torch.randn(B, heads, L_alloc, Dh, generator=g).to(dtype).cuda()
        layers.append(buf[:, :, :L_used])
    keys, values = layers, [t.clone() * 2 for t in layers]
    path = _random_paths(B, N, P, seed=Dh, prefix_lens=prefix_lens, L=L_used)
    ref_k, ref_v = [t.cpu().clone() for t in keys], [t.cpu().clone() for t in values]
    want = compact_kv_reference(ref_k, ref_v, prefix_lens, path)
    got = compact_kv_cuda(keys, values, prefix_lens.cuda(), path.cuda())
    assert torch.equal(got.cpu(), want)
    for i, (g_t, w_t) in enumerate(zip(keys + values, ref_k + ref_v)):
        assert torch.equal(g_t.cpu(), w_t), f"cache tensor {i} differs"


@pytest.mark.gpu
def test_compact_kv_overlap_stress():
    """Long paths that shift almost every row by a little: each source is some later entry's destination."""
    _cuda_ext_or_skip()
    from taps_kernels.cuda_impls import compact_kv_cuda

    B, H, L, Dh, P = 8, 16, 600, 128, 200
    prefix_lens = torch.arange(B, dtype=torch.int64) * 7
    path = torch.full((B, P), -1, dtype=torch.int64)
    for b in range(B):
        n = P - 5 * b
        path[b, :n] = torch.arange(n) + (torch.arange(n) > 0).long() * (1 + b % 3)  # 0, then j + shift
    keys = [torch.randn(B, H, L, Dh, device="cuda", dtype=torch.float16) for _ in range(4)]
    values = [torch.randn(B, H, L, Dh, device="cuda", dtype=torch.float16) for _ in range(4)]
    ref_k, ref_v = [t.cpu() for t in keys], [t.cpu() for t in values]
    want = compact_kv_reference(ref_k, ref_v, prefix_lens, path)
    got = compact_kv_cuda(keys, values, prefix_lens.cuda(), path.cuda())
    torch.cuda.synchronize()
    assert torch.equal(got.cpu(), want)
    for g_t, w_t in zip(keys + values, ref_k + ref_v):
        assert torch.equal(g_t.cpu(), w_t)


@pytest.mark.gpu
def test_default_backend_and_public_ops_on_cuda():
    _cuda_ext_or_skip()
    import taps_kernels

    dev = torch.device("cuda")
    if os.environ.get("TAPS_BACKEND") is None:
        for op in ("tree_mask", "accept_greedy", "compact_kv"):
            assert backend.resolve(op, None, dev)[0] == "cuda"
    tree = _tree(2, 45, vocab=4, seed=9)
    target = _walking_target(tree, seed=9)
    prefix_lens = torch.tensor([3, 8])
    pos, bits = taps_kernels.tree_mask(tree.to(dev), prefix_lens.cuda(), backend="cuda")
    want_pos, want_bits = tree_mask_reference(tree.parents, tree.depth, tree.num_nodes, prefix_lens)
    assert torch.equal(pos.cpu(), want_pos) and torch.equal(bits.cpu(), want_bits)
    got = taps_kernels.accept_greedy(tree.to(dev), target.cuda(), backend="cuda")
    want = accept_greedy_reference(tree.tokens, tree.parents, tree.num_nodes, target, int(tree.depth.max()) + 1)
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w)


@pytest.mark.gpu
def test_library_ops_capture_in_cuda_graph():
    """mask -> accept -> compact (public ops without value checks, as the loop calls them) captured once, replayed
    on new inputs written into the same buffers."""
    import taps_kernels

    _cuda_ext_or_skip()

    B, N, H, L, Dh = 2, 40, 4, 128, 64
    max_depth = N - 1
    trees = [_tree(B, N, vocab=3, seed=s) for s in (11, 12)]
    targets = [_walking_target(t, seed=s) for t, s in zip(trees, (11, 12))]
    prefix_lens = torch.tensor([10, 50], device="cuda")
    static_tree = trees[0].to("cuda")
    static_target = targets[0].cuda()
    keys = [torch.randn(B, H, L, Dh, device="cuda") for _ in range(2)]
    values = [torch.randn(B, H, L, Dh, device="cuda") for _ in range(2)]

    def round_():
        pos, bits = taps_kernels.tree_mask(static_tree, prefix_lens, validate="none")
        path, accept_len, next_token = taps_kernels.accept_greedy(static_tree, static_target, max_depth, validate="none")
        new_lens = taps_kernels.compact_kv(keys, values, prefix_lens, path, validate="none")
        return pos, bits, path, accept_len, next_token, new_lens

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        round_()  # warm-up: uploads and caches the compaction table outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = round_()

    tree, target = trees[1], targets[1]
    for field in ("tokens", "parents", "depth", "num_nodes"):
        getattr(static_tree, field).copy_(getattr(tree, field))
    static_target.copy_(target)
    ref_k, ref_v = [t.cpu() for t in keys], [t.cpu() for t in values]
    graph.replay()
    torch.cuda.synchronize()

    want_pos, want_bits = tree_mask_reference(tree.parents, tree.depth, tree.num_nodes, prefix_lens.cpu())
    want_walk = accept_greedy_reference(tree.tokens, tree.parents, tree.num_nodes, target, max_depth + 1)
    want_lens = compact_kv_reference(ref_k, ref_v, prefix_lens.cpu(), want_walk[0])
    for g, w in zip(outs, (want_pos, want_bits) + tuple(want_walk) + (want_lens,)):
        assert torch.equal(g.cpu(), w)
    for g, w in zip(keys + values, ref_k + ref_v):
        assert torch.equal(g.cpu(), w)
