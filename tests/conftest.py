import asyncio
import os
from pathlib import Path

import pytest

from statekeeper.config import (CompressionConfig, HistoryConfig, LeaseConfig, MiB, ServiceConfig, SessionConfig,
                                TierConfig, WorkerConfig)
from statekeeper.model_loader import load_model
from statekeeper.assembly import build_service
from statekeeper.worker import ModelWorker
from benchmarks.harness.postgres_server import PostgresServer, missing_reason
from benchmarks.harness.redis_server import RedisServer
from benchmarks.harness.tiny_model import make_tiny_model_dir

REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    """The GPU suite (tests marked cuda) runs where a CUDA device is, and is skipped elsewhere."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device (the GPU suite: make test-gpu)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
# The converted SmolLM2 cache is reused across runs (CI and developers); it is gitignored.
MODEL_CACHE = Path(os.environ.get("STATEKEEPER_TEST_MODEL_CACHE", REPO / ".cache" / "models"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture
def base_model_dir(tiny_model_dir, tmp_path) -> tuple[Path, Path]:
    """The tiny model as a base model, with no chat template of its own, and a ChatML template file for
    CHAT_TEMPLATE: (model directory, template file)."""
    import json
    import shutil

    base = tmp_path / "base-model"
    shutil.copytree(tiny_model_dir, base)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    config_path = base / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config.pop("chat_template", None)
    config_path.write_text(json.dumps(tokenizer_config))
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    return base, template


@pytest.fixture(scope="session")
def tiny_worker(tiny_model_dir) -> ModelWorker:
    config = WorkerConfig(model=str(tiny_model_dir), model_cache_dir=MODEL_CACHE, prefill_chunk_tokens=64)
    return ModelWorker(load_model(config.model, config.model_cache_dir), config)


@pytest.fixture(scope="session")
def smollm2_worker() -> ModelWorker:
    config = WorkerConfig(model="smollm2", model_cache_dir=MODEL_CACHE)
    return ModelWorker(load_model(config.model, config.model_cache_dir), config)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def postgres_server():
    """A throwaway PostgreSQL cluster for the session (benchmarks/harness/postgres_server.py)."""
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    server = PostgresServer().start()
    yield server
    server.remove()


@pytest.fixture
def postgres_dsn(postgres_server) -> str:
    """A fresh database of its own for each test."""
    return postgres_server.create_database()


@pytest.fixture
def redis_prefix(request) -> str:
    """Each test's keys live under their own prefix on the shared server."""
    return f"t{abs(hash(request.node.nodeid))}:"


LOSSLESS = CompressionConfig(policy="none", codec="none")


def service_config(data_dir: Path, tiers: tuple[str, ...] = ("dram", "lmdb"), redis_url: str | None = None,
                   redis_prefix: str = "statekeeper:", restore_planning: bool = False,
                   tier_codecs: dict[str, str] | None = None, tier_budget_bytes: int = 512 * MiB,
                   history_dsn: str | None = None, lease: LeaseConfig | None = None,
                   **session_options) -> ServiceConfig:
    paths = {"lmdb": data_dir / "kv.lmdb", "ssd": data_dir / "kv-files"}
    tier_configs = [
        TierConfig(name, tier_budget_bytes, paths.get(name), url=redis_url if name == "redis" else None, key_prefix=redis_prefix,
                   codec=(tier_codecs or {}).get(name, "none"))
        for name in tiers
    ]
    # Lossless unless a test asks otherwise: most tests compare a restored turn with the hot one token by
    # token (the service's default compression is tested on its own in sessions/test_compressed_sessions.py).
    session_options.setdefault("compression", LOSSLESS)
    # Compression on the model thread unless a test asks for the child process (each start loads a model).
    session_options.setdefault("compress_process", False)
    # Unit tests set a service's hardware profile themselves; planning from a measured one is tested apart.
    history = HistoryConfig("postgres", history_dsn, pool_size=4) if history_dsn else HistoryConfig()
    return ServiceConfig(data_dir=data_dir, sessions=SessionConfig(**session_options), tiers=tier_configs,
                         restore_planning=restore_planning, history=history, lease=lease)


@pytest.fixture
def make_service(request, tmp_path, tiny_worker):
    """Builds SessionServices over the tiny worker; closes their stores at the end of the test.
    A service with a redis tier uses the session's real redis-server, or the one at `redis_url`; one with
    `history_dsn` keeps its history in that PostgreSQL database (one with `history`, in that HistoryStore; else
    LMDB in its data directory), and one with `lease` (a LeaseConfig) coordinates its turns with other replicas.
    One given `compress_after_seconds` tests the fixed compression schedule: PLACEMENT_POLICY=lru, the one
    policy that follows it, unless it names another (the default, value, decides compression itself)."""
    built = []

    def make(tiers=("dram", "lmdb"), worker=None, data_dir=None, restore_planning=False, tier_codecs=None,
             redis_url=None, tier_budget_bytes=512 * MiB, history_dsn=None, lease=None, history=None,
             **session_options):
        if "compress_after_seconds" in session_options:  # a test of the fixed schedule, which only lru follows
            session_options.setdefault("placement_policy", "lru")
        redis_options = {}
        if "redis" in tiers:
            redis_options = {"redis_url": redis_url or request.getfixturevalue("redis_server").url,
                             "redis_prefix": request.getfixturevalue("redis_prefix")}
        config = service_config(data_dir or tmp_path, tiers, **redis_options, restore_planning=restore_planning,
                                tier_codecs=tier_codecs, tier_budget_bytes=tier_budget_bytes, history_dsn=history_dsn,
                                lease=lease, **session_options)
        service = build_service(config, worker or tiny_worker, history)
        built.append(service)
        return service

    yield make
    for service in built:
        service.close()


def run(coro):
    return asyncio.run(coro)
