"""A local redis-server for clusters started without `redis_url`.

`ensure_local_redis(port)` starts redis-server on 127.0.0.1 inside a detached, named
Ray actor, so it lives as long as the Ray cluster (not as long as the process that
ran the builder) and a second `serve run` reuses it. The server process gets
PDEATHSIG, so it dies with the actor. Without redis-server on PATH it fails at once
with a one-line install hint.
"""

from __future__ import annotations

import ctypes
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import ray

from deploy.run_cluster import port_taken

ACTOR_NAME = "lorafleet-local-redis"
ACTOR_NAMESPACE = "lorafleet"
INSTALL_HINT = (
    "redis-server not found on PATH; install it (apt-get install redis-server / "
    "brew install redis) or pass redis_url"
)


class RedisNotInstalled(RuntimeError):
    """redis-server is not on PATH."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start_redis_server(port: int | None, data_dir: Path) -> tuple[str, subprocess.Popen]:
    """Start redis-server on 127.0.0.1:port (a free port if None), persistence off.

    Returns (url, process). Raises RedisNotInstalled, or RuntimeError when it does
    not answer within 10 s (the port may be taken).
    """
    exe = shutil.which("redis-server")
    if exe is None:
        raise RedisNotInstalled(INSTALL_HINT)
    if port is None:
        port = free_port()
    elif port_taken("127.0.0.1", port):  # SO_REUSEADDR, as redis-server binds
        raise RuntimeError(f"port {port} on 127.0.0.1 is taken; pick another redis_port or none")
    data_dir.mkdir(parents=True, exist_ok=True)
    args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data_dir)]
    args += ["--save", "", "--appendonly", "no"]
    log = open(data_dir / f"redis-{port}.log", "ab")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    _wait_ready(port, proc)
    return f"redis://127.0.0.1:{port}/0", proc


def _wait_ready(port: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server on port {port} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"redis-server on port {port} did not answer within 10 s")


@ray.remote(num_cpus=0)
class LocalRedis:
    """Owns one redis-server process for the lifetime of the Ray cluster."""

    def __init__(self, port: int | None):
        self.dir = Path(tempfile.mkdtemp(prefix="lorafleet-redis-"))
        self.url, self.proc = start_redis_server(port, self.dir)

    def url_(self) -> str:
        return self.url

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def ensure_local_redis(port: int | None = None) -> str:
    """The URL of the cluster's local redis-server, starting it on first use."""
    if shutil.which("redis-server") is None:
        raise RedisNotInstalled(INSTALL_HINT)
    actor = LocalRedis.options(
        name=ACTOR_NAME, namespace=ACTOR_NAMESPACE, lifetime="detached", get_if_exists=True
    ).remote(port)
    return ray.get(actor.url_.remote())
