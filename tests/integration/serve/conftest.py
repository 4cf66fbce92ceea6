from tests.redis_fixture import redis_server, redis_url  # noqa: F401
