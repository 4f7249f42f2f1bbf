import pytest
from pydantic import ValidationError

from statekeeper.config import MiB
from statekeeper.settings import load_settings
from statekeeper.tenancy import DEFAULT_TENANT


def test_env_vars_and_env_file_reach_the_config(tmp_path, monkeypatch):
    env_file = tmp_path / "statekeeper.env"
    env_file.write_text("STATEKEEPER_DRAM_BUDGET_MB=64\nSTATEKEEPER_PORT=9000\n")
    monkeypatch.setenv("STATEKEEPER_PORT", "9100")  # the environment wins over the file
    monkeypatch.setenv("STATEKEEPER_LMDB_ENABLED", "false")
    monkeypatch.setenv("STATEKEEPER_KV_DTYPE", "bfloat16")
    settings = load_settings(env_file, data_dir=str(tmp_path / "data"))
    config = settings.to_config()
    assert settings.port == 9100
    assert [t.name for t in config.tiers] == ["dram"] and config.tiers[0].budget_bytes == 64 * MiB
    assert config.history_path == tmp_path / "data" / "history.lmdb"
    assert config.worker.model_cache_dir == tmp_path / "data" / "models"
    assert config.worker.kv_dtype == "bfloat16"


def test_request_limits_reach_the_config(tmp_path, monkeypatch):
    for name, value in {"MAX_BODY_MB": "2", "MAX_CONCURRENT_TURNS": "3", "MAX_IDLE_SESSIONS": "0"}.items():
        monkeypatch.setenv(f"STATEKEEPER_{name}", value)
    config = load_settings(data_dir=str(tmp_path)).to_config()
    assert config.max_body_bytes == 2 * MiB
    assert (config.sessions.max_concurrent_turns, config.sessions.max_idle_sessions) == (3, 0)


def test_metrics_are_public_only_when_asked(tmp_path, monkeypatch):
    assert load_settings(data_dir=str(tmp_path)).to_config().metrics_public is False
    monkeypatch.setenv("STATEKEEPER_METRICS_PUBLIC", "true")
    assert load_settings(data_dir=str(tmp_path)).to_config().metrics_public is True


def test_cli_overrides_win(tmp_path):
    settings = load_settings(None, port=8123, host=None, data_dir=str(tmp_path))
    assert settings.port == 8123 and settings.host == "127.0.0.1"


@pytest.mark.parametrize("name, value", [("STATEKEEPER_PORT", "0"), ("STATEKEEPER_TORCH_THREADS", "0"),
                                         ("STATEKEEPER_DTYPE", "int3"), ("STATEKEEPER_SSD_CODEC", "int2"),
                                         ("STATEKEEPER_KV_DTYPE", "int8"),
                                         ("STATEKEEPER_COMPRESSION_CODEC", "int4-g32-rot"),
                                         ("STATEKEEPER_COMPRESSION_CODEC", "int4-g24"),
                                         ("STATEKEEPER_COMPRESSION_CODEC", "int4-vg24"),
                                         ("STATEKEEPER_LMDB_CODEC", "int4-v2-vg48"),
                                         ("STATEKEEPER_COMPRESSION_CODEC", "int4-v3-sym-pk10"),
                                         ("STATEKEEPER_MAX_CONCURRENT_TURNS", "0"),
                                         ("STATEKEEPER_MAX_BODY_MB", "0"),
                                         ("STATEKEEPER_METRICS_PUBLIC", "sometimes"),
                                         # Accepted, then failed at every use or at start-up (from a review):
                                         # BLAKE2b keys hold at most 64 bytes
                                         ("STATEKEEPER_INDEX_SECRET", "ab" * 64),
                                         ("STATEKEEPER_BLOB_SECRET", "ab" * 64),
                                         ("STATEKEEPER_TENANT_RETENTION", '{"*": {"pinned": "false"}}'),
                                         ("STATEKEEPER_TENANT_RETENTION", '{"*": {"ttl_seconds": 3600.5}}'),
                                         ("STATEKEEPER_DEVICE", "gpu"),
                                         ("STATEKEEPER_LEASE_REDIS_URL", "localhost:6379"),
                                         ("STATEKEEPER_EXACT_COPY_TIER", "ssd")])
def test_bad_values_are_refused(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError):
        load_settings()


def test_production_refuses_to_run_without_an_admin_token(monkeypatch):
    monkeypatch.setenv("STATEKEEPER_ENVIRONMENT", "production")
    with pytest.raises(ValidationError, match="ADMIN_TOKEN"):
        load_settings()
    monkeypatch.setenv("STATEKEEPER_ADMIN_TOKEN", "x" * 16)
    assert load_settings().to_config().admin_token == "x" * 16


@pytest.mark.parametrize("token", ["a", "short-token", " " * 16, "\t" * 20, "  0123456789abcdefXYZ  ",
                                   "0123456789abcdefXYZ\n"])
def test_an_admin_token_that_is_short_or_blank_is_refused_in_any_environment(monkeypatch, token):
    """Only production checked the admin token: a service reachable from other machines (HOST=0.0.0.0 requires
    API keys) took a one-character token, which mints keys for any tenant and has no rate limit. Sixteen blank
    characters passed in production, and no request can carry them (header values are trimmed); nor a token
    with blanks around it (every admin request was a 401)."""
    monkeypatch.setenv("STATEKEEPER_HOST", "0.0.0.0")
    monkeypatch.setenv("STATEKEEPER_ADMIN_TOKEN", token)
    with pytest.raises(ValidationError, match="ADMIN_TOKEN"):
        load_settings()


def test_an_empty_admin_token_leaves_the_admin_api_off(monkeypatch):
    """ADMIN_TOKEN= (an env file's empty line, compose's ${STATEKEEPER_ADMIN_TOKEN:-}) is how a deployment
    leaves the admin API off: it must not stop the service from starting."""
    monkeypatch.setenv("STATEKEEPER_ADMIN_TOKEN", "")
    assert load_settings().to_config().admin_token is None


def test_no_secret_shows_in_a_repr(tmp_path, monkeypatch):
    secrets = {"ADMIN_TOKEN": "admin-token-0123456789", "REDIS_PASSWORD": "redis-password-42",
               "BLOB_SECRET": "blob-secret-0123456789abcdefghijklmnop"}
    for name, value in secrets.items():
        monkeypatch.setenv(f"STATEKEEPER_{name}", value)
    monkeypatch.setenv("STATEKEEPER_REDIS_ENABLED", "true")
    monkeypatch.setenv("STATEKEEPER_REDIS_URL", "redis://:url-password-7@cache.internal:6379/0")
    settings = load_settings(data_dir=str(tmp_path))
    config = settings.to_config()
    shown = repr(settings) + str(settings) + repr(config) + str(config) + repr(config.tiers)
    for secret in [*secrets.values(), "url-password-7"]:
        assert secret not in shown
    assert config.admin_token == secrets["ADMIN_TOKEN"] and config.tiers[-1].password == secrets["REDIS_PASSWORD"]
    assert config.tiers[-1].url == "redis://:url-password-7@cache.internal:6379/0"


def test_ssd_and_redis_tiers_follow_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("STATEKEEPER_SSD_ENABLED", "true")
    monkeypatch.setenv("STATEKEEPER_REDIS_ENABLED", "true")
    monkeypatch.setenv("STATEKEEPER_REDIS_URL", "rediss://cache.internal:6380/2")
    monkeypatch.setenv("STATEKEEPER_REDIS_TTL_SECONDS", "3600")
    monkeypatch.setenv("STATEKEEPER_REDIS_CODEC", "int4-rot-g32")
    monkeypatch.setenv("STATEKEEPER_SSD_CODEC", "int4-v3-rot-sym")
    config = load_settings(data_dir=str(tmp_path)).to_config()
    assert [t.codec for t in config.tiers] == ["none", "none", "int4-v3-rot-sym", "int4-rot-g32"]
    assert [t.name for t in config.tiers] == ["dram", "lmdb", "ssd", "redis"]
    assert config.tiers[2].path == tmp_path / "kv-files"
    assert config.tiers[3].url == "rediss://cache.internal:6380/2" and config.tiers[3].ttl_seconds == 3600


def test_the_blob_secret_reaches_the_redis_tier_and_production_with_redis_needs_one(tmp_path, monkeypatch):
    monkeypatch.setenv("STATEKEEPER_REDIS_ENABLED", "true")
    monkeypatch.setenv("STATEKEEPER_BLOB_SECRET", "s" * 32)
    settings = load_settings(data_dir=str(tmp_path))
    config = settings.to_config()
    assert config.tiers[-1].secret == b"s" * 32
    assert "s" * 32 not in repr(settings) + repr(config)
    monkeypatch.setenv("STATEKEEPER_BLOB_SECRET", "too short")
    with pytest.raises(ValidationError, match="BLOB_SECRET"):
        load_settings()
    monkeypatch.delenv("STATEKEEPER_BLOB_SECRET")
    monkeypatch.setenv("STATEKEEPER_ENVIRONMENT", "production")
    monkeypatch.setenv("STATEKEEPER_ADMIN_TOKEN", "x" * 16)
    with pytest.raises(ValidationError, match="BLOB_SECRET"):
        load_settings()


@pytest.mark.parametrize("overrides, env, auth", [
    ({"host": "127.0.0.1"}, {}, "none"),  # `make serve`: open on loopback, and it says so at start
    ({"host": "::1"}, {}, "none"),
    ({"host": "0.0.0.0"}, {}, "api_key"),  # reachable from other machines: keys by default
    ({"host": "127.0.0.1"}, {"STATEKEEPER_ENVIRONMENT": "production", "STATEKEEPER_ADMIN_TOKEN": "x" * 16}, "api_key"),
    ({"host": "0.0.0.0"}, {"STATEKEEPER_AUTH": "none"}, "none"),  # said outright
])
def test_api_keys_are_required_unless_the_service_is_a_loopback_development_one(tmp_path, monkeypatch, overrides,
                                                                                 env, auth):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert load_settings(data_dir=str(tmp_path), **overrides).to_config().auth == auth


def test_the_index_secret_decides_which_conversations_are_found_by_their_messages(tmp_path, monkeypatch, tiny_worker):
    """Replicas that share a history must digest messages alike: with STATEKEEPER_INDEX_SECRET a service
    finds a conversation another one indexed, whatever secret file its data directory holds; without it,
    a service with another secret does not."""
    import asyncio

    from statekeeper.assembly import build_service
    from statekeeper.sessions import TurnRequest

    monkeypatch.setenv("STATEKEEPER_INDEX_SECRET", "i" * 32)
    monkeypatch.setenv("STATEKEEPER_COMPRESSION_POLICY", "none")
    monkeypatch.setenv("STATEKEEPER_COMPRESSION_CODEC", "none")
    config = load_settings(data_dir=str(tmp_path)).to_config()
    assert config.index_secret == b"i" * 32 and "i" * 32 not in repr(config)
    messages = [{"role": "user", "content": "Hello there."}]

    async def first_turn(service):
        session, _, events = await service.chat(messages, TurnRequest("", max_tokens=3, temperature=0))
        async for result in events:
            pass
        return session, [*messages, {"role": "assistant", "content": result.content}, {"role": "user", "content": "And?"}]

    async def found(service, resent) -> str:
        return (await service.resend.resume_point(resent, DEFAULT_TENANT))[0]

    service = build_service(config, tiny_worker)
    session, resent = asyncio.run(first_turn(service))
    service.close()
    (tmp_path / "index-secret").write_bytes(b"another replica's own secret....")
    service = build_service(config, tiny_worker)
    assert asyncio.run(found(service, resent)) == session  # the shared secret, not the file
    service.close()
    monkeypatch.delenv("STATEKEEPER_INDEX_SECRET")
    service = build_service(load_settings(data_dir=str(tmp_path)).to_config(), tiny_worker)
    assert asyncio.run(found(service, resent)) != session  # another secret: another index
    service.close()
    monkeypatch.setenv("STATEKEEPER_INDEX_SECRET", "too short")
    with pytest.raises(ValidationError, match="INDEX_SECRET"):
        load_settings()


def test_a_refused_setting_never_echoes_a_secret(monkeypatch):
    """A service that refuses to start logs why; the why must not carry the admin token or a secret
    (pydantic's errors show the input they refused)."""
    secrets = {"STATEKEEPER_ADMIN_TOKEN": "admin-token-1a2b3c", "STATEKEEPER_REDIS_PASSWORD": "redis-pass-4d5e6f",
               "STATEKEEPER_INDEX_SECRET": "index-secret-7g8h9i-0123456789abcdef"}
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("STATEKEEPER_ENVIRONMENT", "production")
    monkeypatch.setenv("STATEKEEPER_BLOB_SECRET", "short")
    with pytest.raises(ValidationError) as refused:
        load_settings()
    assert "BLOB_SECRET" in str(refused.value)
    assert not any(value[-6:] in str(refused.value) for value in [*secrets.values(), "short"])


def test_the_history_backend_is_lmdb_unless_postgres_is_asked_for_with_a_dsn(tmp_path, monkeypatch):
    config = load_settings(data_dir=str(tmp_path)).to_config()
    assert config.history.backend == "lmdb"  # make serve's embedded default
    monkeypatch.setenv("STATEKEEPER_HISTORY_BACKEND", "postgres")
    with pytest.raises(ValidationError, match="POSTGRES_DSN"):
        load_settings()
    dsn = "postgresql://statekeeper:pg-password-31337@db.internal:5432/statekeeper"
    monkeypatch.setenv("STATEKEEPER_POSTGRES_DSN", dsn)
    monkeypatch.setenv("STATEKEEPER_POSTGRES_POOL_SIZE", "12")
    settings = load_settings(data_dir=str(tmp_path))
    config = settings.to_config()
    assert (config.history.backend, config.history.postgres_dsn, config.history.pool_size) == ("postgres", dsn, 12)
    assert "pg-password-31337" not in repr(settings) + repr(config)
    monkeypatch.setenv("STATEKEEPER_POSTGRES_DSN", "postgresql://u:pg-password-31337@db:notaport/x host=")
    with pytest.raises(ValidationError, match="not a PostgreSQL connection string") as refused:
        load_settings()
    assert "31337" not in str(refused.value)
    monkeypatch.setenv("STATEKEEPER_HISTORY_BACKEND", "mysql")
    with pytest.raises(ValidationError):
        load_settings()


def test_production_over_a_shared_history_needs_the_index_secret(tmp_path, monkeypatch):
    """Without it each replica keeps a key of its own: a conversation committed on one is re-keyed there, and a
    client resending its messages to another finds nothing (a new conversation every turn)."""
    for name, value in {"ENVIRONMENT": "production", "ADMIN_TOKEN": "x" * 16, "HISTORY_BACKEND": "postgres",
                        "POSTGRES_DSN": "postgresql://u:p@db.internal:5432/statekeeper"}.items():
        monkeypatch.setenv(f"STATEKEEPER_{name}", value)
    with pytest.raises(ValidationError, match="INDEX_SECRET"):
        load_settings(data_dir=str(tmp_path))
    monkeypatch.setenv("STATEKEEPER_INDEX_SECRET", "i" * 32)
    assert load_settings(data_dir=str(tmp_path)).to_config().index_secret == b"i" * 32


def test_replicas_coordinate_only_when_a_lease_redis_is_set(tmp_path, monkeypatch):
    assert load_settings(data_dir=str(tmp_path)).to_config().lease is None
    monkeypatch.setenv("STATEKEEPER_LEASE_REDIS_URL", "redis://:lease-password-99@cache.internal:6379/0")
    monkeypatch.setenv("STATEKEEPER_REDIS_KEY_PREFIX", "prod:")
    monkeypatch.setenv("STATEKEEPER_LEASE_WAIT_SECONDS", "0.5")
    settings = load_settings(data_dir=str(tmp_path))
    lease = settings.to_config().lease
    assert (lease.url, lease.key_prefix, lease.ttl_ms, lease.wait_seconds) == (
        "redis://:lease-password-99@cache.internal:6379/0", "prod:", 10_000, 0.5)
    assert "lease-password-99" not in repr(settings) + repr(settings.to_config())
    monkeypatch.setenv("STATEKEEPER_LEASE_TTL_MS", "10")
    with pytest.raises(ValidationError):
        load_settings()
