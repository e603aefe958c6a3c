"""Every environment variable pdserve reads, in one place, read when asked (never at import)."""

from __future__ import annotations

import os


def num_threads() -> int | None:
    """PDSERVE_NUM_THREADS: torch CPU threads for the engine (default: the cores this process may use)."""
    value = os.environ.get("PDSERVE_NUM_THREADS")
    return int(value) if value else None


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def model_cache_dir() -> str:
    """PDSERVE_MODEL_DIR: where `make run` and the CLI keep the models they build (default ./models)."""
    return os.environ.get("PDSERVE_MODEL_DIR", "models")


INTERNAL_TOKEN_VAR = "PDSERVE_INTERNAL_TOKEN"
"""Name of the internal token's variable (the stack launcher passes it on to its processes)."""


def internal_token() -> str | None:
    """PDSERVE_INTERNAL_TOKEN: shared secret the internal RPCs (Worker, KvTransfer) require when set,
    and the key that signs registry records. An environment variable rather than a flag, so it does
    not show in process listings. Unset, a worker or router may bind only to loopback (or use mutual
    TLS) unless started with --insecure-internal; `pdserve serve` generates one."""
    return os.environ.get(INTERNAL_TOKEN_VAR) or None


API_KEY_VAR = "PDSERVE_API_KEY"
"""Name of the public API key's variable (the stack launcher passes it on to its router)."""


def api_key() -> str | None:
    """PDSERVE_API_KEY: a key the router's public API (OpenAI HTTP /v1/*, gRPC Inference) accepts
    as `Authorization: Bearer KEY`, besides any given by --api-key / --api-key-file. Unset and no
    others: the public API is open (as vLLM's without --api-key)."""
    return os.environ.get(API_KEY_VAR) or None


def fault() -> str | None:
    """PDSERVE_FAULT: fault injection for the reliability tests, e.g. "engine_crash_after_steps=3"
    or "engine_stall_after_steps=3" (see services/worker/async_engine.py). Unset in production."""
    return os.environ.get("PDSERVE_FAULT") or None


KV_READ_GATE_VAR = "PDSERVE_KV_READ_GATE"


def kv_read_gate() -> str | None:
    """PDSERVE_KV_READ_GATE: a file path, for the reliability tests: while that file exists, a
    worker's NIXL read of more than one block lands its first block, then waits (saying so in
    the log) until the file is removed, so a test can act in the middle of a read
    (engine/kv_cache/nixl.py). Unset in production."""
    return os.environ.get(KV_READ_GATE_VAR) or None


def log_level() -> str:
    """PDSERVE_LOG_LEVEL: log level of the processes a stack launcher starts (default INFO)."""
    return os.environ.get("PDSERVE_LOG_LEVEL", "INFO")


def native_kernels() -> bool:
    """PDSERVE_NATIVE_KERNELS: "0" keeps the engine on torch's CPU kernels instead of loading its
    native ones (kernels/native; default on where the CPU has AVX512F/BW/VL/DQ, or AVX2 and FMA)."""
    return os.environ.get("PDSERVE_NATIVE_KERNELS", "1") != "0"


def native_amx() -> bool:
    """PDSERVE_NATIVE_AMX: "0" keeps the native kernels' products on VDPBF16PS where the CPU also
    has the AMX tile unit (default: AMX where it is)."""
    return os.environ.get("PDSERVE_NATIVE_AMX", "1") != "0"


AMX_ATTENTION_VAR = "PDSERVE_NATIVE_AMX_ATTENTION"
AMX_ATTENTION_MODES = {"auto": "auto", "1": "tiles", "0": "vdpbf16ps"}


def native_amx_attention() -> str:
    """PDSERVE_NATIVE_AMX_ATTENTION, where the native products run on the AMX tile unit: "1" puts the
    decode attention on the tiles too ("tiles"), "0" keeps it on VDPBF16PS ("vdpbf16ps"), "auto"
    (the default) lets the engine time both at load and keep the faster (engine/platform.py
    pick_decode_attention). -> "auto", "tiles" or "vdpbf16ps"."""
    value = os.environ.get(AMX_ATTENTION_VAR, "auto")
    if value not in AMX_ATTENTION_MODES:
        raise ValueError(
            f"{AMX_ATTENTION_VAR} must be one of {', '.join(AMX_ATTENTION_MODES)}, got {value!r}"
        )
    return AMX_ATTENTION_MODES[value]


def native_bf16() -> bool:
    """PDSERVE_NATIVE_BF16: "0" loads the native kernels built without the AVX512-BF16 instructions
    even where the CPU has them: their AVX512F emulation, as a CPU without them (Skylake-SP to Ice
    Lake) runs, for tests and measurements (default: the instructions where they are)."""
    return os.environ.get("PDSERVE_NATIVE_BF16", "1") != "0"


def native_avx512() -> bool:
    """PDSERVE_NATIVE_AVX512: "0" loads the native kernels built for AVX2 and FMA even where the CPU
    has AVX-512: each 512-bit vector a pair of 256-bit registers, as a CPU without AVX-512 (AMD Zen
    1 to 3, Intel client cores) runs, for tests and measurements (default: AVX-512 where it is)."""
    return os.environ.get("PDSERVE_NATIVE_AVX512", "1") != "0"


def native_build_dir() -> str:
    """PDSERVE_NATIVE_DIR: where a native library the install did not build (a development
    checkout's edited sources) is compiled at first use and cached (default
    $XDG_CACHE_HOME/pdserve/native, or ~/.cache/pdserve/native; kernels/native/build.py)."""
    if value := os.environ.get("PDSERVE_NATIVE_DIR"):
        return value
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "pdserve", "native")
