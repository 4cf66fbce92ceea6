"""A real redis-server for tests: started on a free port in a temp dir, persistence off.

`start_redis(tmpdir, port=None) -> (url, stop)` is usable from any conftest; the
fixtures `redis_server` (session: one server) and `redis_url` (per test: that
server, flushed first) are what tests request. Import both fixtures into a
conftest.py (`from tests.redis_fixture import redis_server, redis_url`).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from tests.polling import wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(tmpdir: str | Path, port: int | None = None) -> tuple[str, Callable[[], None]]:
    """Start redis-server on 127.0.0.1:port (a free one if None) with no persistence.

    Returns (url, stop); stop() terminates the server and waits for it to exit.
    Raises RuntimeError if redis-server is missing or exits at once, TimeoutError if it
    does not answer within 10 s.
    """
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server not found on PATH; run scripts/install.sh")
    port = port or free_port()
    tmp = Path(tmpdir)
    tmp.mkdir(parents=True, exist_ok=True)
    args = [
        exe,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--dir",
        str(tmp),
        "--save",
        "",
        "--appendonly",
        "no",
        "--protected-mode",
        "no",
    ]
    log = open(tmp / f"redis-{port}.log", "ab")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    url = f"redis://127.0.0.1:{port}/0"

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()

    _wait_ready(url, proc, stop)
    return url, stop


def _wait_ready(url: str, proc: subprocess.Popen, stop: Callable[[], None]) -> None:
    client = redis.Redis.from_url(url, socket_connect_timeout=0.2)

    def answers() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode}")
        try:
            return client.ping()
        except redis.ConnectionError:
            return False

    try:
        wait_for(answers, 10, f"redis-server at {url} answering PING", interval_s=0.02)
    except TimeoutError:
        stop()
        raise
    finally:
        client.close()


def dump_redis(url: str) -> dict[bytes, tuple[bytes | None, bool]]:
    """Every key -> (DUMP of its value, has a TTL): compare two dumps to prove nothing changed."""
    client = redis.Redis.from_url(url)
    try:
        return {k: (client.dump(k), client.pttl(k) >= 0) for k in sorted(client.scan_iter("*"))}
    finally:
        client.close()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of one redis-server shared by the whole session."""
    url, stop = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    stop()


@pytest.fixture
def redis_url(redis_server: str) -> str:
    """The session server's URL, flushed so each test starts from an empty Redis."""
    client = redis.Redis.from_url(redis_server)
    client.flushall()
    client.close()
    return redis_server
