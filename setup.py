"""Build and install taps_kernels (kernels) and taps (driver) from source.

The C++ extension ``taps_kernels._C`` is built on every machine with torch's
C++ extension tooling. The CUDA extension ``taps_kernels._C_cuda`` joins the
build only when torch is a CUDA build and nvcc is found.

Environment switches:
  TAPS_CUDA=0      never build the CUDA extension
  TAPS_CUDA=1      require it (fail loudly if it cannot be built)
  TAPS_CUDA=auto   (default) build it when possible
  TAPS_SKIP_CPP=1  build nothing native (pure-Python install; ops fall back to references)
  TAPS_CUDA_ARCHS  e.g. "90" or "80;90" (default: torch's own choice)

The shipped checkpoints (``checkpoints/<name>/``: config, weights, README, metrics) are copied into the
``taps`` package as ``taps/checkpoints/<name>/`` when the package is built, so a wheel carries them and
``taps.paths`` finds them without the source tree.

Wheel: ``pip wheel . --no-build-isolation --no-deps -w dist`` (against the torch already installed).
"""
import glob
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

#: Files of a checkpoint directory that ship (traces and training scratch never live there).
CHECKPOINT_FILES = ("*.json", "*.safetensors", "*.md")

ROOT = os.path.dirname(os.path.abspath(__file__))


def _native_extensions():
    if os.environ.get("TAPS_SKIP_CPP", "0") == "1":
        return [], {}
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    # No fused multiply-add contraction: float results must match the references bit for bit on every ISA.
    cxx_flags = ["-O3", "-std=c++17", "-ffp-contract=off"]
    cpp_sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    extensions = [CppExtension("taps_kernels._C", cpp_sources, include_dirs=[os.path.join(ROOT, "csrc")],
                               extra_compile_args={"cxx": cxx_flags})]

    want_cuda = os.environ.get("TAPS_CUDA", "auto").lower()
    have_nvcc = shutil.which("nvcc") is not None or os.environ.get("CUDA_HOME") is not None
    cuda_torch = torch.version.cuda is not None
    if want_cuda == "1" and not (have_nvcc and cuda_torch):
        raise RuntimeError(
            f"TAPS_CUDA=1 but the CUDA extension cannot be built: nvcc found={have_nvcc}, "
            f"torch CUDA build={cuda_torch} (torch {torch.__version__})")
    if want_cuda != "0" and have_nvcc and cuda_torch:
        archs = os.environ.get("TAPS_CUDA_ARCHS")
        if archs:
            os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(
                f"{a[:-1]}.{a[-1]}" for a in archs.replace(",", ";").split(";") if a)
        cuda_sources = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")) +
                              glob.glob(os.path.join("csrc", "cuda", "*.cpp")))
        if cuda_sources:
            extensions.append(CUDAExtension(
                "taps_kernels._C_cuda", cuda_sources, include_dirs=[os.path.join(ROOT, "csrc")],
                extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++17", "--use_fast_math"]}))
    return extensions, {"build_ext": BuildExtension.with_options(use_ninja=True)}


class BuildPyWithCheckpoints(build_py):
    """build_py that also copies ``checkpoints/<name>/`` into ``taps/checkpoints/<name>/`` of the build."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads checkpoints/ of the checkout itself
        src_root = os.path.join(ROOT, "checkpoints")
        if not os.path.isdir(src_root):
            return
        for name in sorted(os.listdir(src_root)):
            src = os.path.join(src_root, name)
            if not os.path.isfile(os.path.join(src, "config.json")):
                continue
            dst = os.path.join(self.build_lib, "taps", "checkpoints", name)
            self.mkpath(dst)
            for pattern in CHECKPOINT_FILES:
                for f in sorted(glob.glob(os.path.join(src, pattern))):
                    self.copy_file(f, os.path.join(dst, os.path.basename(f)))


ext_modules, cmdclass = _native_extensions()
cmdclass["build_py"] = BuildPyWithCheckpoints

setup(
    name="taps_kernels",
    version="0.1.0",
    description="Kernels and driver for TAPS: target-aware prefix tree selection for diffusion-drafted speculative decoding",
    packages=["taps_kernels", "taps_kernels.reference", "taps_kernels.triton",
              "taps", "taps.models", "taps.decode", "taps.training", "taps.cli", "taps.scoring", "taps.data", "taps.bench",
              "taps.decode.policies", "taps.hf", "taps_kernels.ops", "taps_kernels.integrations"],
    package_dir={"taps_kernels": "taps_kernels", "taps": "python/taps"},
    package_data={"taps": ["assets/*"], "taps.hf": ["custom_generate/*.py", "custom_generate/*.md"]},
    python_requires=">=3.9",
    install_requires=["torch>=2.4", "numpy"],
    extras_require={"triton": ["triton>=3.2"], "driver": ["transformers>=4.56", "safetensors", "tqdm"]},
    entry_points={"console_scripts": ["taps=taps.cli.main:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
