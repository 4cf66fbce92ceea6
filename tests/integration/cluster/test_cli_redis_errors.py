"""Every way the registry's Redis can be wrong ends in one line on stderr and exit 1:
a password required or refused, an ACL denial, a missing database, a server that is not
Redis, a malformed URL. Passwords never reach stderr or --help; `| head` is quiet."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from cluster import ops
from cluster.records import AdapterRecord
from cluster.registry import AsyncRegistry, Registry
from lora_core.errors import RegistryUnavailable
from tests.polling import wait_for
from tests.redis_fixture import free_port

ROOT = Path(__file__).resolve().parents[3]
PASSWORD = "s3cret-pw"


def _cli(url: str, *argv: str, env_url: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LORAFLEET_REDIS_URL": env_url or url}
    return subprocess.run(
        [sys.executable, "-m", "cluster.cli", *argv, "--redis-url", url],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _one_line(proc: subprocess.CompletedProcess) -> str:
    assert (proc.returncode, proc.stdout) == (1, ""), proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("lorafleet: error: "), proc.stderr
    assert PASSWORD not in proc.stderr
    return lines[0].removeprefix("lorafleet: error: ")


@pytest.fixture(scope="module")
def auth_redis(tmp_path_factory) -> Iterator[int]:
    """A redis-server requiring PASSWORD, with an ACL user "ro" that may only GET."""
    port, tmp = free_port(), tmp_path_factory.mktemp("auth-redis")
    args = ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp), "--save", ""]
    proc = subprocess.Popen(
        [shutil.which("redis-server"), *args, "--appendonly", "no", "--requirepass", PASSWORD],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    admin = redis.Redis(port=port, password=PASSWORD, socket_connect_timeout=0.2)

    def add_ro() -> bool:
        try:
            return admin.execute_command("ACL", "SETUSER", "ro", "on", ">ro-pw", "~*", "+get")
        except redis.ConnectionError:  # not listening yet
            return False

    wait_for(add_ro, 10, f"redis-server on port {port} taking the ro user", interval_s=0.1)
    yield port
    admin.close()
    proc.terminate()
    proc.wait(timeout=10)


def test_password_required_but_missing(auth_redis: int):
    url = f"redis://127.0.0.1:{auth_redis}/0"
    msg = _one_line(_cli(url, "adapters", "list"))
    assert msg.startswith(f"Redis at {url} requires a password (")
    assert msg.endswith("allowed: a URL carrying it, redis://[USER]:PASSWORD@HOST:PORT/DB")


def test_wrong_password_is_refused_and_redacted(auth_redis: int):
    url = f"redis://:{PASSWORD}x@127.0.0.1:{auth_redis}/0"
    msg = _one_line(_cli(url, "status"))
    assert msg.startswith(
        f"Redis at redis://:***@127.0.0.1:{auth_redis}/0 refused the user / password of the URL"
    )


def test_wrong_password_in_the_query_is_refused_and_redacted(auth_redis: int):
    url = f"redis://127.0.0.1:{auth_redis}/0?password={PASSWORD}x"
    msg = _one_line(_cli(url, "status"))
    assert PASSWORD not in msg
    assert msg.startswith(
        f"Redis at redis://127.0.0.1:{auth_redis}/0?password=*** refused the user / password "
        "of the URL"
    )


def test_acl_denial_names_the_command(auth_redis: int):
    msg = _one_line(_cli(f"redis://ro:ro-pw@127.0.0.1:{auth_redis}/0", "status"))
    assert msg.startswith(f"Redis at redis://ro:***@127.0.0.1:{auth_redis}/0 denied a command")
    assert "'evalsha'" in msg


def test_right_password_works(auth_redis: int):
    proc = _cli(f"redis://:{PASSWORD}@127.0.0.1:{auth_redis}/0", "tenants", "list", "--json")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "[]\n", "")


def test_database_out_of_range(redis_url: str):
    url = redis_url.rsplit("/", 1)[0] + "/99"
    assert (
        _one_line(_cli(url, "status"))
        == f"Redis at {url} refused the request: DB index is out of range"
    )


@pytest.fixture
def http_port() -> Iterator[int]:
    """A TCP server answering every connection like an HTTP server would."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            with conn:
                conn.recv(4096)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    t.join()
    srv.close()


def test_server_that_is_not_redis(http_port: int):
    url = f"redis://127.0.0.1:{http_port}/0"
    msg = _one_line(_cli(url, "adapters", "list"))
    assert msg.startswith(f"the server at {url} does not speak the Redis protocol (")
    assert msg.endswith("allowed: the URL of a Redis server")


@pytest.mark.parametrize(
    "url, shown, why",
    [
        ("garbage", "garbage", "Redis URL must specify one of the following schemes"),
        (f"redis://:{PASSWORD}@[::1:6379", "redis://***@[::1:6379", "Invalid IPv6 URL"),
        ("redis://127.0.0.1:port/0", "redis://127.0.0.1:port/0", "Port could not be cast"),
        ("redis://127.0.0.1:6379/l", "redis://127.0.0.1:6379/l", "database 'l' is not a number"),
    ],
)
def test_malformed_url(url: str, shown: str, why: str):
    msg = _one_line(_cli(url, "status"))
    assert msg.startswith(f"redis url {shown!r} is invalid ({why}")
    assert msg.endswith(
        "allowed: redis://[[USER]:PASSWORD@]HOST[:PORT][/DB], rediss://... (TLS) or unix:///PATH"
    )


def test_help_never_prints_the_env_password():
    env_url = f"redis://:{PASSWORD}%40@127.0.0.1:1/0"  # '%' would break argparse's help
    proc = _cli(env_url, "adapters", "list", "--help", env_url=env_url)
    assert proc.returncode == 0 and proc.stderr == ""
    assert PASSWORD not in proc.stdout
    assert "redis://:***@127.0.0.1:1/0" in " ".join(proc.stdout.split())


def test_registries_raise_registry_unavailable(auth_redis: int):
    url = f"redis://127.0.0.1:{auth_redis}/0"
    reg = Registry(url, "t")
    with pytest.raises(RegistryUnavailable, match="requires a password"):
        reg.list_tenants()
    with pytest.raises(RegistryUnavailable, match="requires a password"):
        reg.status()
    reg.close()

    async def scenario() -> None:
        areg = AsyncRegistry(url, "t")
        with pytest.raises(RegistryUnavailable, match="requires a password"):
            await areg.desired_state()
        with pytest.raises(RegistryUnavailable, match="requires a password"):
            async with areg.subscribe_hints():
                pass
        await areg.close()

    asyncio.run(scenario())


def test_output_cut_short_by_its_reader_is_quiet(redis_url: str):
    reg = Registry(redis_url, "t")
    for i in range(1500):  # ~200 kB of table: more than a pipe buffer holds
        path = f"/adapters/{i:05d}/" + "x" * 80
        rec = AdapterRecord(
            f"a{i:05d}", 0, "0" * 64, path, 8, "m", ("q_proj",), "", True, 0.0, "active"
        )
        reg._run(ops.register_adapter(rec, False))
    reg.close()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LORAFLEET_NAMESPACE": "t"}
    for extra in ((), ("--json",)):
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cluster.cli",
                "adapters",
                "list",
                *extra,
                "--redis-url",
                redis_url,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert proc.stdout.readline()  # `| head -1`
        proc.stdout.close()
        assert proc.wait(timeout=60) == 141
        assert proc.stderr.read() == b""
        proc.stderr.close()


def test_ctrl_c_while_redis_does_not_answer(tmp_path):
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (backlog), never answers
    url = f"redis://127.0.0.1:{silent.getsockname()[1]}/0"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cluster.cli",
            "status",
            "--redis-url",
            url,
            "--redis-timeout",
            "30",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # a shell runs background jobs with SIGINT ignored, and a child inherits that
        # (Python then installs no KeyboardInterrupt): Ctrl-C reaches a CLI from a
        # terminal, so the CLI starts here as from one, however the suite was started
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    silent.settimeout(30)
    conn, _ = silent.accept()  # started and connected: waiting for the reply (30 s deadline)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    conn.close()
    silent.close()
    assert (proc.returncode, out, err) == (130, "", "lorafleet: interrupted\n")
