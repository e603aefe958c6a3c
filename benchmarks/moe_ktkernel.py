"""kt-kernel's FP8 MoE (its low-level CPUInfer API) on one layer of routed experts, for
benchmarks/moe_quant.py to compare against: runs in a scratch virtual environment that has
kt-kernel (no pdserve imports here). Prints one JSON line: per token count, the median
milliseconds of a forward over the layers given, or the error that stopped it.

    KT=/tmp/ktvenv/bin/python
    $KT benchmarks/moe_ktkernel.py --experts 32 --hidden 512 --inter 256 --top-k 4 --tokens 1,4,16
"""

from __future__ import annotations

import argparse
import json
import time
import traceback


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, required=True)
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--inter", type=int, required=True)
    p.add_argument("--top-k", type=int, required=True)
    p.add_argument("--tokens", default="1,4,16,64,256")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    out: dict = {"engine": "kt-kernel"}
    try:
        import torch

        torch.set_num_threads(args.threads)
        import kt_kernel
        from kt_kernel import kt_kernel_ext
        from kt_kernel_ext.moe import MOEConfig

        out["version"] = getattr(kt_kernel, "__version__", "?")
        out["variant"] = kt_kernel.__cpu_variant__
        from kt_kernel.utils import amx

        backend = amx.AMXFP8_MOE if amx._HAS_FP8_SUPPORT else amx.AVX2FP8_MOE
        if backend is None:
            raise RuntimeError("this kt-kernel build has no FP8 MoE for this CPU (AMXFP8_MOE, AVX2FP8_MOE)")
        out["backend"] = backend.__name__
        config = kt_kernel_ext.WorkerPoolConfig()
        config.subpool_count = 1
        config.subpool_numa_map = [0]
        config.subpool_thread_count = [args.threads]
        cpu = kt_kernel_ext.CPUInfer(config)
        e, h, i, k = args.experts, args.hidden, args.inter, args.top_k
        g = torch.Generator().manual_seed(0)
        max_tokens = max(int(t) for t in args.tokens.split(","))

        def fp8(n: int, m: int) -> tuple[list, list]:
            data = [
                (torch.randn(n, m, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
                for _ in range(e)
            ]
            scale = [torch.full((-(-n // 128), -(-m // 128)), m**-0.5 / 64) for _ in range(e)]
            return data, scale

        layers, keep = [], []
        mask = torch.zeros(e, dtype=torch.bool)  # no expert on a GPU
        identity = torch.arange(
            e, dtype=torch.long
        )  # physical expert -> logical (kept alive: the task reads it)
        for layer in range(args.layers):
            gate, gate_s = fp8(i, h)
            up, up_s = fp8(i, h)
            down, down_s = fp8(h, i)
            cfg = MOEConfig(e, k, h, i, mask.data_ptr())
            cfg.layer_idx = layer
            cfg.pool = cpu.backend_
            cfg.max_len = max_tokens
            cfg.gate_projs = [[t.data_ptr() for t in gate]]
            cfg.up_projs = [[t.data_ptr() for t in up]]
            cfg.down_projs = [[t.data_ptr() for t in down]]
            cfg.gate_scales = [[t.data_ptr() for t in gate_s]]
            cfg.up_scales = [[t.data_ptr() for t in up_s]]
            cfg.down_scales = [[t.data_ptr() for t in down_s]]
            cfg.quant_config.bits = 8
            cfg.quant_config.group_size = 128
            cfg.quant_config.zero_point = False
            moe = backend(cfg)
            cpu.submit(moe.load_weights_task(identity.data_ptr()))
            cpu.sync()
            layers.append(moe)
            keep.append((gate, gate_s, up, up_s, down, down_s, mask))
        out["ms"] = {}
        for t in (int(x) for x in args.tokens.split(",")):
            x = torch.randn(t, h, generator=g).bfloat16()
            y = torch.zeros(t, h, dtype=torch.bfloat16)
            bsz = torch.tensor([t], dtype=torch.int32)
            routes = [
                (torch.rand(t, e, generator=g).topk(k, dim=-1).indices.long().contiguous(), torch.rand(t, k))
                for _ in range(args.steps)
            ]
            times = []
            for _ in range(args.rounds):
                start = time.perf_counter()
                for ids, w in routes:
                    for moe in layers:
                        cpu.submit(
                            moe.forward_task(
                                bsz.data_ptr(),
                                k,
                                ids.data_ptr(),
                                w.data_ptr(),
                                x.data_ptr(),
                                y.data_ptr(),
                                False,
                            )
                        )
                        cpu.sync()
                times.append((time.perf_counter() - start) * 1e3 / (args.steps * len(layers)))
            out["ms"][t] = sorted(times)[len(times) // 2]
    except Exception as exc:  # noqa: BLE001 - recorded: the comparison says why it has no peer
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["trace"] = traceback.format_exc()[-1500:]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
