"""A local redis-server for clusters started without `redis_url`.

`ensure_local_redis(port, data_dir)` starts redis-server on 127.0.0.1 inside a detached,
named Ray actor, so it lives as long as the Ray cluster (not as long as the process that
ran the builder) and a second `serve run` reuses it. The server process gets PDEATHSIG,
so it dies with the actor. Without redis-server on PATH it fails at once with a one-line
install hint.

It requires a password: the registry holds tenants, grants and API key hashes, and any
local user may connect to 127.0.0.1. The password (32 random bytes, urlsafe) reaches
redis-server through a config file, never its command line (which `ps` shows every
user), and the URL with it is written to a file for the operator's CLI; all three are
mode 0600 in the data directory (0700 when made here). With `redis_data_dir` the data
(AOF, fsync every second) and the password stay there across restarts of the cluster;
without, both live in a new temporary directory, the data in memory only.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import ray
import redis

from deploy.run_cluster import port_taken
from lora_core.errors import InvalidRequest

ACTOR_NAME = "lorafleet-local-redis"
ACTOR_NAMESPACE = "lorafleet"
INSTALL_HINT = (
    "redis-server not found on PATH; install it (apt-get install redis-server / "
    "brew install redis) or pass redis_url"
)
PASSWORD_FILE, CONF_FILE, URL_FILE, LOCK_FILE = "password", "redis.conf", "redis.url", "lock"
_PASSWORD = re.compile(r"[A-Za-z0-9_-]{16,}")  # what secrets.token_urlsafe makes


class RedisNotInstalled(RuntimeError):
    """redis-server is not on PATH."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PRCTL = ctypes.CDLL("libc.so.6", use_errno=True).prctl
"""Looked up here, not in the child: between fork and exec of a process with other threads
(Ray's, gRPC's) the child should do as little as it can. The one flaky start seen
(redis-server "exited with -6" at start, CI 2026-12-06; not reproduced since) had the
child load libc and set its umask in Python there: the likeliest suspect, now gone."""
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)  # die with the actor


def _private(path: str, flags: int) -> int:
    """open()'s opener for files only we may read (mode 0600, also when they existed)."""
    fd = os.open(path, flags | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)
    return fd


def write_private(path: Path, text: str) -> None:
    with open(path, "w", opener=_private) as f:
        f.write(text)


def redis_password(data_dir: Path) -> str:
    """The password in data_dir/password, made there (32 random bytes) when missing: a
    server restarted on the same data keeps the password its clients know."""
    path = data_dir / PASSWORD_FILE
    if not path.exists():
        write_private(path, secrets.token_urlsafe(32) + "\n")
    os.chmod(path, 0o600)
    password = path.read_text().strip()
    if not _PASSWORD.fullmatch(password):
        raise RuntimeError(
            f"{path} holds no valid password; allowed: 16+ characters of letters, digits, "
            "'-', '_' (or remove the file: a new password is made)"
        )
    return password


def _lock(data_dir: Path) -> int:
    """An exclusive lock on data_dir (its fd): two servers appending to one AOF would
    corrupt it."""
    fd = os.open(data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(
            f"{data_dir} is in use by another redis-server (another Ray cluster's); allowed: "
            "stop that cluster first, or another redis_data_dir"
        ) from None
    return fd


def start_redis_server(
    port: int | None, data_dir: Path, *, persist: bool = False
) -> tuple[str, subprocess.Popen]:
    """Start redis-server on 127.0.0.1:port (a free port if None), requiring the password
    of data_dir (see redis_password). persist: keep the data in data_dir (AOF, fsync every
    second, no RDB snapshots), else in memory only. data_dir/redis.url gets the URL.

    Returns (url, process); the URL carries the password (print `cluster.client.redact`
    of it). Raises RedisNotInstalled, or RuntimeError when the port or data_dir is taken
    or it does not answer within 10 s.
    """
    exe = shutil.which("redis-server")
    if exe is None:
        raise RedisNotInstalled(INSTALL_HINT)
    if port is None:
        port = free_port()
    elif port_taken("127.0.0.1", port):  # SO_REUSEADDR, as redis-server binds
        raise RuntimeError(f"port {port} on 127.0.0.1 is taken; pick another redis_port or none")
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    lock = _lock(data_dir)
    try:
        password = redis_password(data_dir)
        write_private(data_dir / CONF_FILE, f"requirepass {password}\n")
        args = [exe, str(data_dir / CONF_FILE), "--port", str(port), "--bind", "127.0.0.1"]
        aof = ["yes", "--appendfsync", "everysec"] if persist else ["no"]
        args += ["--dir", str(data_dir), "--save", "", "--appendonly", *aof]
        with open(data_dir / "redis.log", "ab", opener=_private) as log:
            # the lock goes with the server: held while it runs, even past this process
            proc = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
                umask=0o077,  # its AOF and snapshots hold the registry: readable by us only
                pass_fds=(lock,),
            )
    finally:
        os.close(lock)
    _wait_ready(port, password, proc)
    url = f"redis://:{password}@127.0.0.1:{port}/0"
    write_private(data_dir / URL_FILE, url + "\n")
    return url, proc


def _wait_ready(port: int, password: str, proc: subprocess.Popen) -> None:
    """Until it answers PING (a persistent one loads its AOF first)."""
    client = redis.Redis(port=port, password=password, socket_connect_timeout=0.2)
    deadline = time.monotonic() + 10
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server on port {port} exited with {proc.returncode}")
            try:
                client.ping()
                return
            except redis.ConnectionError:  # not listening yet, or loading its data
                time.sleep(0.05)
    finally:
        client.close()
    proc.kill()
    proc.wait()
    raise RuntimeError(f"redis-server on port {port} did not answer within 10 s")


@ray.remote(num_cpus=0)
class LocalRedis:
    """Owns one redis-server process for the lifetime of the Ray cluster."""

    def __init__(self, port: int | None, data_dir: str):
        self.data_dir = data_dir
        self.dir = Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="lorafleet-redis-"))
        self.url, self.proc = start_redis_server(port, self.dir, persist=bool(data_dir))

    def url_(self) -> str:
        return self.url

    def url_file_(self) -> str:
        return str(self.dir / URL_FILE)

    def data_dir_(self) -> str:
        return self.data_dir

    def port_(self) -> int:
        return int(self.url.rsplit(":", 1)[1].split("/", 1)[0])

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def ensure_local_redis(port: int | None = None, data_dir: str = "") -> str:
    """The URL (password included) of the cluster's local redis-server, starting it on
    first use. InvalidRequest when it runs already with another data_dir, or on another
    port than a port asked for: that one would be used without a word, and what is
    registered kept where the config does not say."""
    if shutil.which("redis-server") is None:
        raise RedisNotInstalled(INSTALL_HINT)
    actor = LocalRedis.options(
        name=ACTOR_NAME, namespace=ACTOR_NAMESPACE, lifetime="detached", get_if_exists=True
    ).remote(port, data_dir)
    running = ray.get(actor.data_dir_.remote())
    if running != data_dir:
        raise InvalidRequest(
            f"cluster args: redis_data_dir={data_dir!r}, but this Ray cluster's local "
            f"redis-server runs with {running!r} already ('' = in memory); allowed: the same "
            "redis_data_dir, or another one on a new Ray cluster (ray stop, then serve run)"
        )
    running_port = ray.get(actor.port_.remote())
    if port is not None and running_port != port:
        raise InvalidRequest(
            f"cluster args: redis_port={port}, but this Ray cluster's local redis-server "
            f"runs on port {running_port} already; allowed: redis_port {running_port} or "
            "none, or another port on a new Ray cluster (ray stop, then serve run)"
        )
    return ray.get(actor.url_.remote())


def local_redis_url_file() -> str:
    """The file (mode 0600) holding the URL of the running local redis-server."""
    actor = ray.get_actor(ACTOR_NAME, namespace=ACTOR_NAMESPACE)
    return ray.get(actor.url_file_.remote())
