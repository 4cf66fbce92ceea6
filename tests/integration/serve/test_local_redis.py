"""deploy.local_redis: a real redis-server starts, requires its password (kept off the
command line and out of every printed line), answers, keeps its data in redis_data_dir
across restarts, and dies with us; the Ray actor hands every `serve run` the same URL."""

import asyncio
import os
import socket
import stat
import subprocess
from pathlib import Path

import pytest
import ray
import redis

from cluster.client import redact
from cluster.registry import AsyncRegistry, Registry
from deploy.builder import local_registry, parse_args
from deploy.local_redis import (
    ACTOR_NAME,
    ACTOR_NAMESPACE,
    INSTALL_HINT,
    PASSWORD_FILE,
    RedisNotInstalled,
    ensure_local_redis,
    local_redis_url_file,
    start_redis_server,
)
from lora_core.errors import InvalidRequest, RegistryUnavailable

pytestmark = pytest.mark.integration


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(timeout=10)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_starts_on_127_0_0_1_and_answers(tmp_path):
    url, proc = start_redis_server(None, tmp_path)
    try:
        password = (tmp_path / PASSWORD_FILE).read_text().strip()
        assert url == f"redis://:{password}@127.0.0.1:{_port(url)}/0"
        assert len(password) == 43  # 32 random bytes, urlsafe base64
        client = redis.Redis.from_url(url)
        assert client.ping()
        client.close()
    finally:
        _stop(proc)


def test_a_password_is_required_and_the_url_carries_it(tmp_path):
    url, proc = start_redis_server(None, tmp_path)
    try:
        bare = redis.Redis(port=_port(url), socket_connect_timeout=1)
        with pytest.raises(redis.AuthenticationError):
            bare.set("k", "v")
        bare.close()
        with socket.create_connection(("127.0.0.1", _port(url)), timeout=1) as s:
            s.sendall(b"GET k\r\n")
            assert s.recv(64).startswith(b"-NOAUTH")
        # the registry client, as the ingress, the replicas and the CLI open it
        reg = Registry(url, "t")
        reg.create_tenant("acme")
        assert reg.list_tenants() == ["acme"]
        reg.close()

        async def listed() -> list[str]:
            areg = AsyncRegistry(url, "t")  # as the ingress and the replicas open it
            try:
                return await areg.list_tenants()
            finally:
                await areg.close()

        assert asyncio.run(listed()) == ["acme"]
        no_password = Registry(f"redis://127.0.0.1:{_port(url)}/0", "t")
        with pytest.raises(RegistryUnavailable, match="requires a password"):
            no_password.list_tenants()
        no_password.close()
    finally:
        _stop(proc)


def test_the_password_is_not_on_the_command_line_and_its_files_are_private(tmp_path):
    url, proc = start_redis_server(None, tmp_path)
    try:
        password = url.split(":")[2].split("@")[0]
        # what it was started with: redis-server retitles itself once up ("redis-server
        # 127.0.0.1:PORT"), but ps shows the arguments until then
        assert password not in " ".join(proc.args)
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert b"redis-server" in cmdline and password.encode() not in cmdline
        ps = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True)
        assert f"127.0.0.1:{_port(url)}" in ps.stdout and password not in ps.stdout
        for name in ("password", "redis.conf", "redis.url"):
            assert _mode(tmp_path / name) == 0o600, name
        assert (tmp_path / "redis.url").read_text() == url + "\n"
    finally:
        _stop(proc)


def test_persists_across_a_restart_on_the_same_data_dir(tmp_path):
    data = tmp_path / "made" / "here"
    url, proc = start_redis_server(None, data, persist=True)
    assert _mode(data) == 0o700
    try:
        reg = Registry(url, "t")
        reg.create_tenant("acme")
        key = reg.issue_api_key("acme")
        reg.close()
    finally:
        _stop(proc)  # SIGTERM, as the actor's death sends it: the AOF is flushed
    assert any(p.is_file() for p in (data / "appendonlydir").iterdir())
    # the AOF holds key hashes and grants: readable by the cluster's user only
    assert {_mode(p) for p in data.rglob("*")} == {0o600, 0o700}
    url2, proc2 = start_redis_server(None, data, persist=True)
    try:
        assert url2.split("@")[0] == url.split("@")[0]  # the same password
        reg = Registry(url2, "t")
        assert reg.list_tenants() == ["acme"]
        assert reg.resolve_key(key) == "acme"
        reg.close()
    finally:
        _stop(proc2)


def test_without_persistence_a_restart_starts_empty(tmp_path):
    url, proc = start_redis_server(None, tmp_path)
    try:
        redis.Redis.from_url(url).set("k", "v")
    finally:
        _stop(proc)
    url2, proc2 = start_redis_server(None, tmp_path)
    try:
        assert redis.Redis.from_url(url2).get("k") is None
    finally:
        _stop(proc2)


def test_a_data_dir_in_use_is_refused(tmp_path):
    url, proc = start_redis_server(None, tmp_path, persist=True)
    try:
        with pytest.raises(RuntimeError, match="is in use by another redis-server"):
            start_redis_server(None, tmp_path, persist=True)
    finally:
        _stop(proc)


def test_a_password_file_it_did_not_write_is_refused(tmp_path):
    (tmp_path / PASSWORD_FILE).write_text("short\nrename-command FLUSHALL x\n")
    with pytest.raises(RuntimeError, match="holds no valid password"):
        start_redis_server(None, tmp_path)


def test_a_taken_port_fails_fast(tmp_path):
    url, proc = start_redis_server(None, tmp_path / "a")
    port = _port(url)
    try:
        with pytest.raises(RuntimeError, match=f"port {port}"):
            start_redis_server(port, tmp_path / "b")
    finally:
        _stop(proc)


def test_missing_redis_server_gives_the_install_hint_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RedisNotInstalled) as e:
        start_redis_server(None, tmp_path)
    assert str(e.value) == INSTALL_HINT
    assert "\n" not in INSTALL_HINT
    with pytest.raises(RedisNotInstalled):
        ensure_local_redis()


def test_a_port_just_given_up_can_be_taken_again(tmp_path):
    # A cluster restarted with the same redis_port: the stopped Redis closed its clients'
    # connections first, so its port holds them in TIME_WAIT for a minute; redis-server
    # itself binds such a port, and so must the check before it.
    url, proc = start_redis_server(None, tmp_path / "a")
    client = redis.Redis.from_url(url)
    assert client.ping()
    _stop(proc)
    client.close()
    url2, proc2 = start_redis_server(_port(url), tmp_path / "b")
    try:
        assert _port(url2) == _port(url)
        assert redis.Redis.from_url(url2).ping()
    finally:
        _stop(proc2)


@pytest.fixture
def local_ray():
    if ray.is_initialized():  # a previous module's Ray: this test needs its own
        ray.shutdown()
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        try:
            actor = ray.get_actor(ACTOR_NAME, namespace=ACTOR_NAMESPACE)
            ray.get(actor.stop.remote())
            ray.kill(actor)
        except ValueError:  # never started
            pass
        ray.shutdown()


def test_the_actor_hands_out_one_url_and_the_builder_prints_it_masked(local_ray, tmp_path, capsys):
    data = str(tmp_path / "redis")
    url = local_registry(parse_args({"redis_data_dir": data}))
    line = capsys.readouterr().err
    password = url.split(":")[2].split("@")[0]
    assert password not in line
    assert line.startswith(f"lorafleet: local registry at {redact(url)} (export ")
    assert redact(url).startswith("redis://:***@127.0.0.1:")
    # the export the line offers gives the operator's CLI the whole URL
    export = line.split("(export ", 1)[1].rstrip().removesuffix(")")
    shell = subprocess.run(["bash", "-c", f"{export}; printf %s \"$LORAFLEET_REDIS_URL\""],
                           capture_output=True, text=True, check=True)  # fmt: skip
    assert shell.stdout == url
    assert local_redis_url_file() == f"{data}/redis.url"
    assert ensure_local_redis(data_dir=data) == url  # a second `serve run`
    with pytest.raises(InvalidRequest, match="runs with .* already"):
        ensure_local_redis()  # in memory, while it keeps its data in data
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    assert ensure_local_redis(port, data) == url  # its own port, asked for: the same server
    with pytest.raises(InvalidRequest, match=f"redis_port={port + 1}, but .* runs on port {port}"):
        ensure_local_redis(port + 1, data)  # another port would be ignored without a word
    reg = Registry(url, "t")
    reg.create_tenant("acme")
    assert reg.list_tenants() == ["acme"]
    reg.close()
    assert os.listdir(data)
