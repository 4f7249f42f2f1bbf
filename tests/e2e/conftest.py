import pytest

from tests.conftest import MODEL_CACHE
from benchmarks.harness.live_server import live_server
from benchmarks.harness.openai_server import Server
from benchmarks.harness.replica_server import ReplicaServer, start_all


@pytest.fixture
def servers(make_service, tmp_path):
    """A statekeeper server (DRAM, then LMDB) and a reference that keeps no state: its one tier has no
    room, so a state that leaves memory is gone and each of its turns recomputes from the history."""
    stateful = make_service(data_dir=tmp_path / "stateful")
    stateless = make_service(tiers=("dram",), tier_budget_bytes=1, data_dir=tmp_path / "stateless")
    with live_server(stateful) as url, live_server(stateless) as reference_url:
        yield Server(url), Server(reference_url)


def replica_settings(postgres_dsn: str, redis_url: str, model_dir, key_prefix: str) -> dict:
    """What replicas sharing one PostgreSQL history and one Redis (leases and the shared KV tier) are
    started with: the tiny model, lossless (policy none)."""
    return {
        "MODEL": model_dir, "MODEL_CACHE_DIR": MODEL_CACHE, "DEVICE": "cpu", "PREFILL_CHUNK_TOKENS": 64,
        "HISTORY_BACKEND": "postgres", "POSTGRES_DSN": postgres_dsn,
        "LEASE_REDIS_URL": redis_url, "LEASE_WAIT_SECONDS": 1.0,
        "REDIS_ENABLED": "true", "REDIS_URL": redis_url, "REDIS_KEY_PREFIX": key_prefix,
        "BLOB_SECRET": "replica-blob-secret-0123456789abcdef", "INDEX_SECRET": "replica-index-secret-0123456789abcdef",
        "COMPRESSION_POLICY": "none", "COMPRESS_PROCESS": "false", "RESTORE_PLANNING": "false",
    }


@pytest.fixture
def start_replicas(redis_server, tiny_model_dir, tmp_path):
    """Starts `statekeeper serve` processes over one history (a DSN) and the session's Redis; stops them
    after the test."""
    started = []

    def start(postgres_dsn: str, count: int = 2, **settings) -> list[ReplicaServer]:
        shared = replica_settings(postgres_dsn, redis_server.url, tiny_model_dir, f"{tmp_path.name}:") | settings
        servers = start_all([ReplicaServer(tmp_path / f"replica-{len(started) + i}", shared) for i in range(count)])
        started.extend(servers)
        return servers

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def replicas(postgres_server, redis_server, tiny_model_dir, tmp_path_factory):
    """Two `statekeeper serve` processes on their own ports sharing one PostgreSQL history and one Redis,
    for a module's tests."""
    root = tmp_path_factory.mktemp("replicas")
    shared = replica_settings(postgres_server.create_database(), redis_server.url, tiny_model_dir, f"{root.name}:")
    servers = start_all([ReplicaServer(root / name, shared) for name in ("a", "b")])
    try:
        yield servers
    finally:
        for server in servers:
            server.stop()
