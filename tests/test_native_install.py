"""The native CPU kernels ship built (kernels/native/build.py, setup.py's build step).

- A wheel built from the files the Dockerfile's build stage copies holds every ISA level's library
  and the CRC-32C helper, tagged for this platform; installed into a fresh virtual environment and
  run with no compiler on PATH (the image's runtime stage has none), `pdserve kernels --check`
  passes, and a bf16 model generates through the kernels for this CPU from that install, with
  nothing compiled.
- Where no library matches the sources (a development checkout edited since it was installed),
  the first use compiles one into the build folder, saying so, and later uses load it.
- Each CPU takes the best level it can run.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from kernels.native import build

REPO = Path(__file__).resolve().parent.parent


def _docker_copies() -> list[str]:
    """The paths the Dockerfile's build stage copies from the context (its COPY lines)."""
    text = (REPO / "Dockerfile").read_text()
    stage = text.split("FROM ", 2)[1]  # the first stage: the build
    paths = []
    for line in re.findall(r"^COPY (?!--)(.+)$", stage, re.M):
        *sources, _dest = line.split()
        paths += sources
    return paths


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel of the Dockerfile's files, built as the image builds it (pip, no build isolation:
    this venv's torch). The libraries this checkout's install built are in the copy's prebuilt
    folder: the build reuses them by name (the same sources, flags and torch), as it would a
    checkout's, rather than compile three libraries again here (the install did that)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "prebuilt")
    for name in _docker_copies():
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    if build.PREBUILT.is_dir():
        shutil.copytree(build.PREBUILT, src / "kernels" / "native" / "prebuilt")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (whl,) = tmp.glob("pdserve-*.whl")
    return whl


def test_the_wheel_holds_every_level_and_the_sources(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    libs = [*(build.kernels(v) for v in build.VARIANTS.values()), build.CRC32C]
    for lib in libs:
        assert f"kernels/native/prebuilt/{lib.file_name()}" in names, lib.prefix
    assert {"kernels/native/decode_bf16.cpp", "kernels/native/common.h", "engine/kv_cache/crc32c.c"} <= set(
        names
    )
    assert "modelkit/make_model.py" in names  # `pdserve serve`'s default model is built by it
    tag = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    assert wheel.name.endswith(f"-cp311-cp311-{tag}.whl"), wheel.name  # not py3-none-any


def test_a_fresh_install_without_a_compiler_loads_this_cpus_kernels(wheel, tmp_path, tiny_model):
    # A fresh venv; its dependencies (torch, ...) from this one's site-packages, read through a
    # path entry (not as a site dir: this venv's editable install of the checkout stays out).
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    site = Path(
        subprocess.check_output(
            [venv / "bin" / "python", "-c", "import site; print(site.getsitepackages()[0])"], text=True
        ).strip()
    )
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q"]
    run = subprocess.run(
        [*install, "--no-deps", "--no-index", str(wheel)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]

    cache = tmp_path / "native-cache"  # where a missing library would be compiled
    env = {
        "PATH": str(venv / "bin"),  # no c++, cc or gcc
        "HOME": str(tmp_path),
        "PDSERVE_NATIVE_DIR": str(cache),
        "OMP_NUM_THREADS": "1",
        "PDSERVE_NUM_THREADS": "1",
    }
    assert not any(shutil.which(cc, path=env["PATH"]) for cc in ("c++", "cc", "gcc", "g++"))

    def pdserve(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(venv / "bin" / "pdserve"), "--log-level", "INFO", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    run = pdserve("kernels", "--check")
    assert run.returncode == 0, run.stdout + run.stderr
    installed = site / "kernels" / "native" / "prebuilt"
    variant = build.choose(frozenset(_cpu_flags()))
    assert variant is not None, "the test machine runs one of the native builds"
    assert f"loaded: {installed / build.kernels(variant).file_name()}" in run.stdout, run.stdout

    made = pdserve("make-model", "tiny", "--out", str(tmp_path / "pdserve-tiny"))
    assert made.returncode == 0, made.stderr[-3000:]
    run = pdserve(
        "generate", "--model", tiny_model, "--dtype", "bfloat16", "--prompt", "def f(x):", "--max-tokens", "4"
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"native CPU kernels loaded from {installed}" in run.stderr, run.stderr[-3000:]
    assert "compiling" not in run.stderr and not cache.exists()  # nothing was built at run time


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_edited_sources_compile_once_at_first_use_and_say_so(tmp_path, monkeypatch, caplog):
    """A library whose prebuilt file does not match its sources: the first use compiles it into the
    build folder (a warning says so) and loads from there after; a missing compiler is an OSError
    the caller turns into the torch path, and leaves nothing half-built."""
    source = tmp_path / "crc.c"
    source.write_bytes(build.CRC32C.source.read_bytes() + b"\n/* edited */\n")
    lib = build.Library("pdserve_crc32c", source, (), build.CRC32C.cflags, torch_extension=False)
    assert not (build.PREBUILT / lib.file_name()).exists()  # the edit changed the name
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger=build.__name__):
        first = build.find_or_build(lib, cache, "KV checksums")
    assert first == cache / lib.file_name() and first.exists()
    assert any("compiling it into" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=build.__name__):
        assert build.find_or_build(lib, cache, "KV checksums") == first
    assert not caplog.records  # found, not compiled

    source.write_bytes(source.read_bytes() + b"/* again */\n")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.raises(OSError):
        build.find_or_build(lib, cache, "KV checksums")
    assert sorted(p.name for p in cache.iterdir()) == [first.name]  # no temporary left behind


@pytest.mark.parametrize(
    "flags, want",
    [
        ({"avx2", "fma", "f16c"}, "avx2"),
        ({"avx2", "fma"}, None),  # no F16C: none (every AVX2 CPU has it)
        ({"avx2", "fma", "f16c", *build.AVX512_FLAGS}, "avx512"),
        ({"avx2", "fma", "f16c", *build.AVX512_FLAGS, "avx512_bf16", "amx_tile", "amx_bf16"}, "avx512_bf16"),
        ({"avx2", "fma", "f16c", "avx512f"}, "avx2"),  # AVX512F alone lacks the 16-bit masked loads
        ({"avx", "sse4_2"}, None),
    ],
    ids=["avx2", "avx2-no-f16c", "avx512", "amx", "avx512f-only", "avx"],
)
def test_each_cpu_takes_the_best_level_it_runs(flags, want):
    chosen = build.choose(frozenset(flags))
    assert (chosen.name if chosen else None) == want
    if chosen is not None:
        assert set(chosen.cpu_flags) <= flags
    # Passing over levels, as the tests and measurements do (PDSERVE_NATIVE_BF16 / _AVX512=0).
    if want == "avx512_bf16":
        assert build.choose(frozenset(flags), bf16=False).name == "avx512"
        assert build.choose(frozenset(flags), avx512=False).name == "avx2"


def test_every_level_compiles_for_any_cpu_by_its_own_flags():
    """The three variants differ in their ISA flags only, and the build needs no CPU of theirs
    (the compiler targets each; a wheel built anywhere holds all three)."""
    assert len({v.cflags for v in build.VARIANTS.values()}) == 3
    for v in build.VARIANTS.values():
        command = build.kernels(v).command(Path("/tmp/x.so"))
        assert all(flag in command for flag in v.cflags)
        assert "-march=native" not in command and "-DTORCH_EXTENSION_NAME=x" in command
    assert os.path.basename(build.CRC32C.command(Path("/tmp/y.so"))[0])  # a C compiler's name
