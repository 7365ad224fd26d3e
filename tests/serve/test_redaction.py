"""Secrets in store URLs are redacted however the query spells their names: percent-encoded (`?pass%77ord=`, which
redis-py decodes and authenticates with), in any case, or under another secret's name (token, key, ...). That a
gateway's warnings and answers hold none of them, `?pass%77ord=` among them, is test_stores's
`test_redis_passwords_are_redacted_in_every_message`."""

from __future__ import annotations

import pytest

from vit_serve.serve.stores.redaction import redacted, secret_name


def test_a_percent_encoded_password_authenticates_with_redis_and_is_redacted(redis_with_password):
    """redis-py reads `?pass%77ord=` as the password (a real redis-server with requirepass accepts it), so it is
    one: redacted in `redacted` and in the settings' repr."""
    import redis

    from vit_serve.serve.settings import ServeSettings

    url, password, _ = redis_with_password
    encoded = f"{url}?pass%77ord={password}"
    with redis.Redis.from_url(encoded) as client:
        assert client.ping() is True
    assert password not in redacted(encoded) and "pass%77ord=***" in redacted(encoded)
    assert password not in repr(ServeSettings(model="m.onnx", store=encoded))


@pytest.mark.parametrize("name", ["password", "pass%77ord", "PASSWORD", "Pa%53s%57oRd", "pwd", "token",
                                  "access_token", "Api-Key", "api%5Fkey", "key", "x-api-key", "secret",
                                  "client_secret"])
def test_secret_query_names_are_redacted_whatever_their_spelling(name):
    url = f"redis://127.0.0.1:6379/0?db=1&{name}=s3cret-value&socket_timeout=2"
    assert secret_name(name)
    out = redacted(f"cannot reach {url}; retrying")
    assert "s3cret" not in out and f"{name}=***" in out and "db=1" in out and "socket_timeout=2" in out


@pytest.mark.parametrize("name", ["db", "socket_timeout", "keys", "monkey", "tokens_per_s", "passage"])
def test_other_query_names_are_kept(name):
    url = f"redis://127.0.0.1:6379/0?{name}=visible"
    assert not secret_name(name) and redacted(url) == url
