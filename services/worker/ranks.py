"""`pdserve worker --dp N [--ep N]`: launch this machine's N rank processes of a DP(/EP) group.

Each rank is a full worker (its own engine, scheduler, KV cache, gRPC server on `--port + i`,
registry entry with its dp_rank). With `--ep`, the ranks form one torch.distributed group over
which the routed experts are spread; a multi-node group starts the same command on every node
with `--dp-rank-offset` and a shared `--dist-master-addr/--dist-master-port`. This parent only
supervises: it forwards SIGTERM/SIGINT, and if a rank exits with an error the others are stopped
too (a group cannot serve without all its ranks).
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time

from services.launcher import free_port

logger = logging.getLogger(__name__)

_PER_RANK = ("--dp", "--port", "--metrics-port", "--dp-rank", "--group-rank", "--dist-master-port")


def _without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in flags:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def launch_ranks(argv: list[str], args) -> int:
    """Run args.dp rank processes of this node and wait for them; returns the worst exit code."""
    master_port = args.dist_master_port or free_port(args.dist_master_addr)
    if args.dist_master_port == 0 and (args.dp_rank_offset or args.ep and args.ep > args.dp):
        raise ValueError("a group spanning machines needs --dist-master-port (and --dist-master-addr)")
    base = _without(argv, _PER_RANK)
    procs = []
    for i in range(args.dp):
        rank = args.dp_rank_offset + i
        cmd = [
            sys.executable,
            "-m",
            "services.cli",
            *base,
            "--dp",
            "1",
            "--group-rank",
            str(rank),
            "--dp-rank",
            str(rank),
        ]
        cmd += ["--port", str(args.port + i), "--dist-master-port", str(master_port)]
        if args.metrics_port is not None:
            cmd += ["--metrics-port", str(args.metrics_port + i)]
        procs.append(subprocess.Popen(cmd))
    stopping = False

    def forward(sig, _frame) -> None:
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    while any(p.poll() is None for p in procs):
        failed = [p for p in procs if p.returncode not in (None, 0)]
        if failed and not stopping:
            logger.error(
                "rank process %d exited with %d; stopping the group", failed[0].pid, failed[0].returncode
            )
            forward(signal.SIGTERM, None)
        time.sleep(0.2)
    return max(p.returncode for p in procs)
