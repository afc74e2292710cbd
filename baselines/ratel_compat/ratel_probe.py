"""What Ratel's main.py needs from its environment, checked before it runs (with this layer installed).

Run as `python ratel_probe.py` with this directory and the checkout on PYTHONPATH; prints one JSON
object: {"torch": version or null, "cuda": torch's CUDA or null, "missing": [one line per problem]}.
"""
import importlib
import json
import os
import subprocess
import sys

# what imports it: main.py needs each of these before its first iteration
MODULES = {
    "torch": "everything",
    "einops": "gpt_model.py's rearrange",
    "psutil": "see_mem.py",
    "ninja": "the op builders' JIT build of cpu_adam and async_io",
    "distutils": "the op builders (from setuptools on Python >= 3.12)",
    "flash_attn.flash_attention": "gpt_model.py's attention (this layer's shim)",
}


def nvcc_release(cuda_home: str) -> str:
    out = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "-V"], capture_output=True, text=True).stdout
    words = out.split()
    return words[words.index("release") + 1].rstrip(",")


def main() -> dict:
    report = {"torch": None, "cuda": None, "missing": []}
    for name, why in MODULES.items():
        try:
            importlib.import_module(name)
        except Exception as e:  # an import that fails for any reason is a missing piece
            report["missing"].append(f"{name} ({why}): {type(e).__name__}: {e}")
    if "torch" not in sys.modules:
        return report
    import torch
    report["torch"], report["cuda"] = torch.__version__, torch.version.cuda
    if not torch.cuda.is_available():
        report["missing"].append("a CUDA GPU (torch.cuda.is_available() is False): main.py runs on cuda:0")
    from torch.utils.cpp_extension import CUDA_HOME
    if not CUDA_HOME:
        report["missing"].append("a CUDA toolkit (CUDA_HOME): the op builders read its version and libraries")
    else:
        try:
            release = nvcc_release(CUDA_HOME)
        except (OSError, ValueError, IndexError) as e:
            report["missing"].append(f"nvcc under CUDA_HOME={CUDA_HOME}: {e}")
        else:
            ours = ".".join((torch.version.cuda or "").split(".")[:2])
            if release != ours:  # the trimmed builder raises on a mismatch and has no DS_SKIP_CUDA_CHECK
                report["missing"].append(f"nvcc {release} matching torch's CUDA {ours}: Ratel's op builder "
                                         "refuses a mismatch")
    try:
        from op_ds.ops.op_builder.async_io import AsyncIOBuilder
        # the activation swapper builds async_io in every mode; is_compatible links a call to io_submit
        if not AsyncIOBuilder().is_compatible(verbose=False):
            report["missing"].append("libaio (async_io's compile-and-link check of io_submit failed): "
                                     "eval \"$(baselines/libaio.sh env .libaio)\" before the run")
    except Exception as e:
        report["missing"].append(f"op_ds.ops.op_builder.async_io: {type(e).__name__}: {e}")
    return report


if __name__ == "__main__":
    print(json.dumps(main()))
