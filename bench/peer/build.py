"""Build SGLang's HiSparse swap-in kernel from its wheel, for issue 33's side-by-side (nothing vendored).

    python3 bench/peer/build.py                      # pip download sglang==0.5.23 and apache-tvm-ffi, build .peer/
    python3 bench/peer/build.py --sglang-wheel W --tvm-ffi-wheel T

Extracts from the sglang wheel the JIT headers (`sglang/kernels/jit/include/**`) and the kernel's source
(`sglang/kernels/jit/csrc/kvcacheio/hisparse.cuh`), and from the apache-tvm-ffi wheel its C++ headers (the
peer's tensor helpers include them; nothing links against tvm-ffi, since bench/peer/hisparse_peer.cu launches the
`__global__` kernel itself), into .peer/src (git-ignored). Then nvcc compiles bench/peer/hisparse_peer.cu
against them for sm_90a with the flags sglang's `load_jit` passes (`-DSGL_CUDA_ARCH=900 -std=c++20 -O3
--expt-relaxed-constexpr`) into .peer/libhisparse_peer.so (cudart linked statically; ~1.1 MB), and writes
.peer/build.json: the wheels and their sha256, hisparse.cuh's sha256, nvcc's version and the command.

nvcc runs on the CPU machine (this repository's has CUDA 13.0, as the device image does); the device call
carries .peer/ (`carry [".whl", ".peer"]`) and dlopens the library; the wheels and extracted headers are
deleted after the build (only the library and build.json travel).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SGLANG = "sglang==0.5.23"  # the version issue 33 names
TVM_FFI = "apache-tvm-ffi"
KERNEL = "sglang/kernels/jit/csrc/kvcacheio/hisparse.cuh"
FLAGS = ["-DSGL_CUDA_ARCH=900", "-std=c++20", "-O3", "--expt-relaxed-constexpr", "-arch=sm_90a",
         "-shared", "-Xcompiler", "-fPIC"]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def download(spec: str, dest: Path) -> Path:
    """The wheel pip downloads for `spec` (no dependencies) into dest."""
    before = set(dest.glob("*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(dest), spec], check=True)
    new = sorted(set(dest.glob("*.whl")) - before) or sorted(dest.glob(spec.split("=")[0].replace("-", "_") + "*.whl"))
    if not new:
        raise SystemExit(f"pip download {spec}: no wheel in {dest}")
    return new[-1]


def extract(wheel: Path, prefixes: tuple[str, ...], dest: Path) -> int:
    """Members of wheel under any of prefixes, into dest; how many."""
    n = 0
    with zipfile.ZipFile(wheel) as z:
        for m in z.namelist():
            if m.startswith(prefixes) and not m.endswith("/"):
                z.extract(m, dest)
                n += 1
    return n


def build(sglang_wheel: Path, tvm_wheel: Path, out: Path, nvcc: str = "nvcc") -> dict:
    """Extract, compile, and describe the build (the dict written to out/build.json)."""
    src = out / "src"
    shutil.rmtree(src, ignore_errors=True)
    n = extract(sglang_wheel, ("sglang/kernels/jit/include/", KERNEL), src)
    n += extract(tvm_wheel, ("tvm_ffi/include/",), src)
    lib = out / "libhisparse_peer.so"
    inc = [f"-I{src / d}" for d in ("sglang/kernels/jit/include", "sglang/kernels/jit/csrc", "tvm_ffi/include")]
    cmd = [nvcc, *FLAGS, *inc, "-o", str(lib), str(ROOT / "bench/peer/hisparse_peer.cu")]
    subprocess.run(cmd, check=True)
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    doc = {"sglang_wheel": sglang_wheel.name, "sglang_wheel_sha256": sha256(sglang_wheel),
           "tvm_ffi_wheel": tvm_wheel.name, "tvm_ffi_wheel_sha256": sha256(tvm_wheel),
           "kernel_source": KERNEL, "kernel_source_sha256": sha256(src / KERNEL), "files_extracted": n,
           "nvcc": version, "command": " ".join(cmd), "library": lib.name, "library_sha256": sha256(lib)}
    (out / "build.json").write_text(json.dumps(doc, indent=1))
    return doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sglang-wheel", type=Path, default=None, help=f"default: pip download {SGLANG}")
    ap.add_argument("--tvm-ffi-wheel", type=Path, default=None, help=f"default: pip download {TVM_FFI}")
    ap.add_argument("--out", type=Path, default=ROOT / ".peer")
    ap.add_argument("--nvcc", default=os.environ.get("NVCC", "nvcc"))
    ns = ap.parse_args(argv)
    wheels = ns.out / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    sg = ns.sglang_wheel or download(SGLANG, wheels)
    tv = ns.tvm_ffi_wheel or download(TVM_FFI, wheels)
    doc = build(sg, tv, ns.out, ns.nvcc)
    for d in (wheels, ns.out / "src"):  # 42 MB and 2 MB: only the library and build.json travel to the device
        shutil.rmtree(d, ignore_errors=True)
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
