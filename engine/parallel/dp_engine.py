"""The offline face of a DP/EP group: N rank processes, each an EngineCore, behind the
EngineClient interface (engine/client.py) that EngineCore implements too, so `LLM` drives either.

Requests go to the rank with the fewest in flight. Each rank process loops: take commands from
its pipe, then `core.step()` in lockstep with the other ranks (an idle rank runs a dummy batch
while another has work), and send its outputs back. Stopping is agreed through the same per-step
all-reduce, so no rank is left waiting in a collective. A rank that fails reports why and the
client raises; a rank killed outright makes its peers' next collective fail within the group
timeout, and the client raises too.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from multiprocessing.connection import Connection, wait

from engine.client import run_step_loop
from engine.config import EngineConfig, ModelConfig
from engine.loader import check_model_folder
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams, validate_request
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_IDLE_POLL_S = 0.002
RANK_NAME_PREFIX = "pdserve-dp"
"""Rank processes are named pdserve-dp<rank>; spawn names them before it re-imports __main__."""
EXIT_MAIN_REIMPORTED = 86
"""A rank's exit code when the script that started it built a DP engine again while spawn
re-imported it (no `if __name__ == "__main__":` guard)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, cfg: EngineConfig, conn: Connection) -> None:
    """Entry point of one rank process."""
    import torch

    from engine.engine_core import EngineCore
    from engine.gc_heap import freeze_startup_heap
    from engine.parallel.groups import GroupConfig, ParallelGroup

    core = None
    try:
        group = None
        if cfg.enable_expert_parallel:
            group = ParallelGroup(
                GroupConfig(
                    rank,
                    cfg.data_parallel_size,
                    cfg.dist_master_addr,
                    cfg.dist_master_port,
                    cfg.dist_timeout_s,
                ),
                torch.device(cfg.device),
            )
        core = EngineCore(cfg, group=group)
        # A rank keeps its engine until it exits, and steps in lockstep with the others: a full
        # collection walking its startup heap would stall every rank (engine/gc_heap.py).
        frozen = freeze_startup_heap()
        conn.send(
            (
                "ready",
                {
                    "max_model_len": core.max_model_len,
                    "num_kv_blocks": core.num_kv_blocks,
                    "block_size": core.kv_spec.block_size,
                },
            )
        )
        stop = False

        def take_commands(timeout: float) -> None:
            nonlocal stop
            while conn.poll(timeout):
                op, *args = conn.recv()
                if op == "add":
                    core.add_request(*args)
                elif op == "abort":
                    out = core.abort_request(*args)
                    if out is not None:
                        conn.send(("out", [out]))
                elif op == "stop":
                    stop = True
                timeout = 0

        def deliver(outs: list[RequestOutput]) -> None:
            if outs:
                conn.send(("out", outs))

        run_step_loop(
            core,
            take_commands=take_commands,
            deliver=deliver,
            stopping=lambda: stop,
            idle_wait_s=_IDLE_POLL_S,
        )
        conn.send(("stopped", core.parallel_stats() | {"gc_frozen_objects": frozen}))
    except BaseException as e:  # noqa: BLE001 - reported to the client, then the process exits 1
        try:
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        except OSError:
            pass
        os._exit(1)
    finally:
        if core is not None and core.group is not None:
            core.group.close()


def _main_guard_help() -> str:
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    script = f" ({main})" if main else ""
    return (
        "the rank processes are started with multiprocessing's 'spawn' method, which re-imports "
        f"the main module{script}, and that module builds the data-parallel engine again at import "
        "time (LLM(..., data_parallel_size > 1) outside a main guard). Put the code that builds and "
        'uses the LLM under `if __name__ == "__main__":`'
    )


def _refuse_in_rank_bootstrap() -> None:
    """In a rank process that spawn is still bootstrapping, building a DP engine means the user's
    script runs unguarded: say so on this rank's stderr and exit with EXIT_MAIN_REIMPORTED, which
    the parent turns into the same explanation (multiprocessing would refuse a bit later with a
    RuntimeError the parent never sees)."""
    if not mp.current_process().name.startswith(RANK_NAME_PREFIX):  # ranks never build one
        return
    print(f"pdserve data-parallel rank: {_main_guard_help()}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_MAIN_REIMPORTED)


class DPEngineClient:
    """Drives N rank processes; an EngineClient, single-threaded like EngineCore."""

    group = None
    """The client is not a rank itself: it steps only while requests are in flight."""

    def __init__(self, cfg: EngineConfig):
        _refuse_in_rank_bootstrap()
        # Set before any rank starts: the failure path and __del__ read them.
        self.conns: list[Connection] = []
        self.procs = []
        self.requests: dict[str, int] = {}
        """request_id -> the rank running it (see has_request)."""
        self._in_flight = [0] * cfg.data_parallel_size
        self.final_stats: dict[int, dict] = {}
        folder = check_model_folder(cfg.model)
        if cfg.enable_expert_parallel and cfg.dist_master_port == 0:
            cfg = dataclasses.replace(cfg, dist_master_port=_free_port())
        self.cfg = cfg
        self.model_cfg = ModelConfig.from_pretrained(folder)
        self.tokenizer = Tokenizer(folder)
        ctx = mp.get_context("spawn")
        for rank in range(cfg.data_parallel_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_rank_main, args=(rank, cfg, child), name=f"{RANK_NAME_PREFIX}{rank}", daemon=True
            )
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        infos = [self._expect(rank, "ready") for rank in range(cfg.data_parallel_size)]
        self.max_model_len = min(i["max_model_len"] for i in infos)
        self.num_kv_blocks = min(i["num_kv_blocks"] for i in infos)
        self.block_size = infos[0]["block_size"]
        """Tokens per engine block: the KV spec's (DeepSeek-V4 rounds cfg.block_size up)."""

    def _fail(self, rank: int, why: str):
        self.requests.clear()  # the group is gone: nothing left to abort
        self.shutdown(force=True)
        raise RuntimeError(f"data-parallel rank {rank} failed: {why}")

    def _exited(self, rank: int, what: str) -> str:
        """Why rank's process is gone (`what` happened), once it has exited (a few seconds at most)."""
        proc = self.procs[rank]
        proc.join(timeout=5.0)
        if proc.exitcode == EXIT_MAIN_REIMPORTED:
            return f"it exited before it started: {_main_guard_help()}"
        return f"{what} (exit code {proc.exitcode})"

    def _expect(self, rank: int, kind: str):
        conn = self.conns[rank]
        while not conn.poll(0.5):
            if not self.procs[rank].is_alive():
                self._fail(rank, self._exited(rank, "it exited"))
        try:
            msg_kind, payload = conn.recv()
        except EOFError:
            msg_kind, payload = None, None
        if msg_kind is None:
            self._fail(rank, self._exited(rank, "its pipe closed"))
        if msg_kind == "error":
            self._fail(rank, payload)
        assert msg_kind == kind, (msg_kind, kind)
        return payload

    # ---- the EngineCore interface -------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        validate_request(
            prompt_token_ids,
            params,
            self.model_cfg.vocab_size,
            self.max_model_len,
            self.block_size,
            self.num_kv_blocks,
        )

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None
    ):
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        rank = min(range(len(self.procs)), key=lambda r: self._in_flight[r])
        self.conns[rank].send(("add", request_id, list(prompt_token_ids), params, prompt))
        self.requests[request_id] = rank
        self._in_flight[rank] += 1

    def abort_request(self, request_id: str) -> None:
        rank = self.requests.get(request_id)
        if rank is not None and self.procs[rank].is_alive():
            self.conns[rank].send(("abort", request_id))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def step(self) -> list[RequestOutput]:
        """Outputs from whichever ranks have some (waits until at least one output arrives)."""
        outputs: list[RequestOutput] = []
        while not outputs and self.requests:
            ready = wait(self.conns, timeout=1.0)
            if not ready:
                for rank, proc in enumerate(self.procs):
                    if not proc.is_alive():
                        self._fail(rank, self._exited(rank, "it exited"))
                continue
            for conn in ready:
                rank = self.conns.index(conn)
                try:
                    kind, payload = conn.recv()
                except EOFError:
                    kind, payload = None, None
                if kind is None:
                    self._fail(rank, self._exited(rank, "its pipe closed"))
                if kind == "error":
                    self._fail(rank, payload)
                for out in payload or []:
                    if out.finished and self.requests.pop(out.request_id, None) is not None:
                        self._in_flight[rank] -= 1
                    outputs.append(out)
        return outputs

    def shutdown(self, force: bool = False) -> None:
        """Stop every rank together; `final_stats[rank]` then holds each rank's parallel_stats()
        and gc_frozen_objects, the objects it froze out of the collector's scans at startup."""
        for conn, proc in zip(self.conns, self.procs, strict=True):
            if proc.is_alive() and not force:
                try:
                    conn.send(("stop",))
                except OSError:
                    pass
        if not force:
            for rank, conn in enumerate(self.conns):
                deadline = time.monotonic() + self.cfg.dist_timeout_s
                while self.procs[rank].is_alive() or conn.poll(0):
                    if not conn.poll(min(0.5, max(deadline - time.monotonic(), 0))):
                        if time.monotonic() > deadline:
                            break
                        continue
                    try:
                        kind, payload = conn.recv()
                    except EOFError:
                        break
                    if kind == "stopped":
                        self.final_stats[rank] = payload
                        break
        for proc in self.procs:
            proc.join(timeout=0 if force else self.cfg.dist_timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
