"""deploy.local_redis without Ray: a real redis-server starts, answers, and dies with us."""

import pytest
import redis

from deploy.local_redis import (
    INSTALL_HINT,
    RedisNotInstalled,
    ensure_local_redis,
    start_redis_server,
)

pytestmark = pytest.mark.integration


def test_starts_on_127_0_0_1_and_answers(tmp_path):
    url, proc = start_redis_server(None, tmp_path)
    try:
        assert url.startswith("redis://127.0.0.1:")
        client = redis.Redis.from_url(url)
        assert client.ping()
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_taken_port_fails_fast(tmp_path):
    url, proc = start_redis_server(None, tmp_path / "a")
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    try:
        with pytest.raises(RuntimeError, match=f"port {port}"):
            start_redis_server(port, tmp_path / "b")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


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
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    client = redis.Redis.from_url(url)
    assert client.ping()
    proc.terminate()
    proc.wait(timeout=10)
    client.close()
    url2, proc2 = start_redis_server(port, tmp_path / "b")
    try:
        assert url2 == url
        assert redis.Redis.from_url(url2).ping()
    finally:
        proc2.terminate()
        proc2.wait(timeout=10)
