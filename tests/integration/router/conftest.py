"""Fixtures of the router integration tests: a real redis-server (no Ray)."""

from __future__ import annotations

from tests.redis_fixture import redis_server, redis_url  # noqa: F401
