"""Building the native CPU kernels: one shared library per ISA level, ahead of time.

`pip install` (and so the image build and `make`) compiles every variant below into `PREBUILT`
inside the package (setup.py's `build_native` command calls `build_all`); a CPU picks its
variant when the engine starts (kernels/native `load`), as PyTorch's own CPU dispatch and
kt-kernel's per-ISA extensions do. A runtime image needs no compiler. Only a development checkout
whose sources changed since it was installed compiles at first use (`build_into`, into the user's
cache, logged), and so does `engine/kv_cache/crc32c.c` (`CRC32C`), the KV checksums' helper.

A library is named by its variant and a key over its sources, its flags and the torch version it
links against, so a stale build is never loaded: after an edit, or under another torch, the name
differs and the prebuilt file is simply not found.

This module imports nothing of the project (setup.py loads it by path) and torch only inside the
functions that compile.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
PREBUILT = HERE / "prebuilt"
"""Where `pip install` puts the libraries it built (package data of the wheel)."""

SOURCE = HERE / "decode_bf16.cpp"
HEADERS = tuple(
    HERE / name
    for name in (
        "pool.h",
        "common.h",
        "tiles.h",
        "products.h",
        "products_avx2.h",
        "quantized.h",
        "experts.h",
        "attention.h",
        "layer.h",
        "argmax.h",
        "spec.h",
        "sparse.h",
        "v4.h",
        "extend.h",
        "avx2.h",
    )
)
"""Included by SOURCE: part of every kernel library's key."""

AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
"""/proc/cpuinfo flags the AVX-512 builds need: 512-bit float32 arithmetic and the masked 16-bit
loads and stores (Intel from Skylake-SP, AMD from Zen 4)."""
AVX2_FLAGS = ("avx2", "fma", "f16c")
BF16_FLAG = "avx512_bf16"


@dataclass(frozen=True)
class Variant:
    """One ISA level's build of the kernels."""

    name: str
    """"avx2", "avx512" or "avx512_bf16"; part of the library's file name."""
    cflags: tuple[str, ...]
    """Compiler flags of this level (besides the common ones)."""
    cpu_flags: tuple[str, ...]
    """/proc/cpuinfo flags a CPU needs to run it."""
    summary: str
    """What it is for, in a line (`pdserve kernels`). The AMX tile paths live in avx512_bf16,
    compiled by target attribute and taken at run time where the CPU has amx_tile and amx_bf16."""


VARIANTS = {
    v.name: v
    for v in (
        Variant(
            "avx2",
            ("-O3", "-fopenmp", "-mavx2", "-mfma", "-mf16c"),
            AVX2_FLAGS,
            "AVX2 + FMA + F16C, 512-bit vectors as register pairs (Zen 1-3, Intel client cores)",
        ),
        Variant(
            "avx512",
            ("-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
            AVX512_FLAGS,
            "AVX-512, AVX512-BF16 emulated (Skylake-SP to Ice Lake)",
        ),
        Variant(
            "avx512_bf16",
            ("-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16"),
            (*AVX512_FLAGS, BF16_FLAG),
            "AVX-512 + AVX512-BF16, and AMX where the CPU has it (Zen 4/5, Sapphire Rapids on)",
        ),
    )
}


def choose(cpu_flags: frozenset[str], avx512: bool = True, bf16: bool = True) -> Variant | None:
    """The variant this CPU runs best: AVX-512 with BF16, else AVX-512, else AVX2; None where it
    runs none. avx512 / bf16 False pass over those levels (tests and measurements)."""
    if avx512 and all(f in cpu_flags for f in AVX512_FLAGS):
        return VARIANTS["avx512_bf16" if bf16 and BF16_FLAG in cpu_flags else "avx512"]
    if all(f in cpu_flags for f in AVX2_FLAGS):
        return VARIANTS["avx2"]
    return None


@dataclass(frozen=True)
class Library:
    """A shared library to build from C/C++ sources: its file name is `name(...)`."""

    prefix: str
    """File name's start, e.g. "pdserve_native_avx2"; a Python extension's module name is the
    whole stem (PyInit_<stem>)."""
    source: Path
    includes: tuple[Path, ...]
    """Files the source includes: part of the key."""
    cflags: tuple[str, ...]
    torch_extension: bool
    """A Python extension against torch's headers and libraries (the kernels), or plain C (CRC32C)."""

    def key(self) -> str:
        """16 hex digits over the sources, the flags and (for an extension) torch's version."""
        digest = hashlib.sha256()
        for path in (self.source, *self.includes):
            digest.update(path.read_bytes())
        digest.update(" ".join(self.cflags).encode())
        if self.torch_extension:
            import torch

            digest.update(torch.__version__.encode())
        return digest.hexdigest()[:16]

    def file_name(self) -> str:
        return f"{self.prefix}_{self.key()}.so"

    def command(self, out: Path) -> list[str]:
        """The compiler's command line building this library at `out`."""
        if not self.torch_extension:
            cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
            return [*cc.split(), *self.cflags, "-shared", "-fPIC", str(self.source), "-o", str(out)]
        from torch.utils import cpp_extension

        includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
        (lib_dir,) = cpp_extension.library_paths()
        cxx = os.environ.get("CXX") or "c++"
        return [
            *cxx.split(),
            f"-DTORCH_EXTENSION_NAME={out.stem}",
            "-DTORCH_API_INCLUDE_EXTENSION_H",
            *(f"-isystem{p}" for p in includes),
            "-fPIC",
            "-std=c++20",
            *self.cflags,
            str(self.source),
            "-shared",
            f"-L{lib_dir}",
            "-lc10",
            "-ltorch_cpu",
            "-ltorch",
            "-ltorch_python",
            "-o",
            str(out),
        ]


def kernels(variant: Variant) -> Library:
    return Library(f"pdserve_native_{variant.name}", SOURCE, HEADERS, variant.cflags, torch_extension=True)


CRC32C = Library(
    "pdserve_crc32c",
    HERE.parent.parent / "engine" / "kv_cache" / "crc32c.c",
    (),
    ("-O2", "-pthread"),
    torch_extension=False,
)
"""The KV checksums' CRC-32C (engine/kv_cache/checksum.py), four blocks side by side."""


def compiler_found(lib: Library) -> bool:
    return shutil.which(lib.command(Path("x.so"))[0]) is not None


def compile_into(lib: Library, folder: Path, timeout_s: float = 600.0) -> Path:
    """Compile `lib` into folder/<file_name>: built aside and renamed (a reader never sees half a
    file), under a lock other processes building the same library wait on (released by the
    kernel if its holder dies). -> the library's path. CalledProcessError (with the compiler's
    output) or OSError when it cannot be built."""
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / lib.file_name()
    lock_path = folder / f"{out.stem}.lock"
    try:
        with open(lock_path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if out.exists():  # another process built it while we waited
                return out
            with tempfile.TemporaryDirectory(dir=folder, prefix=".building-") as tmp:
                built = Path(tmp) / out.name
                subprocess.run(lib.command(built), check=True, capture_output=True, timeout=timeout_s)
                os.replace(built, out)
        return out
    finally:
        with contextlib.suppress(OSError):
            lock_path.unlink()


def find_or_build(lib: Library, cache: Path, what: str) -> Path:
    """The library's prebuilt file (PREBUILT, from `pip install`), else one built before into
    `cache`, else built there now: a development checkout whose sources changed since it was
    installed (logged, with the time it took). `what` names it in the log."""
    name = lib.file_name()
    for folder in (PREBUILT, cache):
        if (folder / name).exists():
            return folder / name
    logger.warning(
        "%s: no prebuilt %s (the sources changed since `pip install`, or another torch); "
        "compiling it into %s, once",
        what,
        name,
        cache,
    )
    start = time.monotonic()
    path = compile_into(lib, cache)
    logger.info("%s: compiled in %.1f s", what, time.monotonic() - start)
    return path


def build_all(
    folder: Path = PREBUILT, jobs: int | None = None, reuse: Path | None = None, log=print
) -> list[Path]:
    """Every variant of the kernels and the CRC-32C helper into `folder` (setup.py's build step),
    `jobs` at a time (default: the CPUs), replacing older builds there; a library `reuse` already
    holds (the same name: the same sources, flags and torch) is copied instead. -> the libraries."""
    libs = [*(kernels(v) for v in VARIANTS.values()), CRC32C]
    folder.mkdir(parents=True, exist_ok=True)
    keep = {lib.file_name() for lib in libs}
    for old in folder.glob("pdserve_*.so"):
        if old.name not in keep:
            old.unlink()

    def one(lib: Library) -> Path:
        start, name = time.monotonic(), lib.file_name()
        if (folder / name).exists():
            log(f"{name} is up to date")
            return folder / name
        if reuse is not None and (reuse / name).exists():
            shutil.copy2(reuse / name, folder / name)
            log(f"reused {name} from {reuse}")
            return folder / name
        path = compile_into(lib, folder)
        log(f"built {name} in {time.monotonic() - start:.0f} s")
        return path

    jobs = jobs or len(os.sched_getaffinity(0))
    log(f"building the native CPU kernels ({', '.join(VARIANTS)}) and CRC-32C, {jobs} at a time")
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        return list(pool.map(one, libs))


if __name__ == "__main__":  # python kernels/native/build.py [FOLDER]: what setup.py runs
    import sys

    build_all(Path(sys.argv[1]) if len(sys.argv) > 1 else PREBUILT)
