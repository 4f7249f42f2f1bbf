"""docker-compose.yml works as written (issue 16), checked without a Docker engine: Debian's docker-compose
(scripts/install-test-deps.sh) resolves it with the checked-in example env file, and the resolved services
are held to what they must be: statekeeper healthy on /healthz, non-root, waiting for a password-protected
and healthy Redis, its environment a valid production configuration of statekeeper.settings; Prometheus
scrapes /metrics with the admin token, and every metric the Grafana dashboard plots is one the service
exports. The image's steps are `make serve`'s, so the tests that run `make test` cover what the image runs."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from statekeeper.settings import Settings

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
ENV_EXAMPLE = REPO / "docker" / "statekeeper.env.example"
DOCKERFILE = REPO / "docker" / "Dockerfile"
PROMETHEUS = REPO / "docker" / "prometheus" / "prometheus.yml"
GRAFANA = REPO / "docker" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "statekeeper.json"


def docker_compose(*args: str, env_file: Path = ENV_EXAMPLE) -> subprocess.CompletedProcess:
    binary = shutil.which("docker-compose")
    if binary is None:
        raise RuntimeError("docker-compose is not installed: run scripts/install-test-deps.sh")
    return subprocess.run([binary, "-f", str(COMPOSE), "--project-directory", str(REPO), "--env-file",
                           str(env_file), *args], capture_output=True, text=True, timeout=120)


def resolved(*profiles: str) -> dict:
    flags = [arg for profile in profiles for arg in ("--profile", profile)]
    result = docker_compose(*flags, "config")
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


@pytest.fixture(scope="module")
def config() -> dict:
    return resolved()


@pytest.fixture(scope="module")
def monitoring() -> dict:
    return resolved("monitoring")


@pytest.fixture(scope="module")
def scale() -> dict:
    return resolved("scale")


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments left out."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip()) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def dockerfile_env() -> dict[str, str]:
    env = {}
    for instruction, args in dockerfile_instructions():
        if instruction == "ENV":
            env.update(pair.split("=", 1) for pair in shlex.split(args))
    return env


def test_both_profiles_validate(config, monitoring):
    assert {"statekeeper", "redis"} <= set(config["services"])
    assert {"statekeeper", "redis", "prometheus", "grafana"} <= set(monitoring["services"])
    assert monitoring["services"]["prometheus"]["profiles"] == ["monitoring"]
    assert monitoring["services"]["grafana"]["profiles"] == ["monitoring"]
    for name in ("statekeeper", "redis"):
        assert "profiles" not in config["services"][name]  # `docker compose up` starts them


def test_a_missing_secret_stops_compose_before_anything_starts(tmp_path):
    empty = tmp_path / "empty.env"
    empty.write_text("")
    result = docker_compose("config", env_file=empty)
    assert result.returncode != 0
    assert "STATEKEEPER_" in result.stderr


def test_the_example_env_file_holds_placeholders_only():
    values = dict(line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines()
                  if line.strip() and not line.startswith("#"))
    secrets = {name: value for name, value in values.items() if "TOKEN" in name or "SECRET" in name
               or "PASSWORD" in name}
    assert secrets and all(value.startswith("CHANGE-ME") for value in secrets.values()), secrets


def test_statekeeper_is_healthchecked_on_healthz_and_waits_for_a_healthy_redis(config):
    statekeeper = config["services"]["statekeeper"]
    test = statekeeper["healthcheck"]["test"]
    assert test[0] in ("CMD", "CMD-SHELL") and any("/healthz" in part for part in test)
    assert statekeeper["depends_on"]["redis"]["condition"] == "service_healthy"
    redis = config["services"]["redis"]
    assert redis["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL")
    assert "ping" in " ".join(redis["healthcheck"]["test"])
    # The image's own HEALTHCHECK (for `docker run`) probes the same URL.
    assert any(i == "HEALTHCHECK" and "/healthz" in args for i, args in dockerfile_instructions())


def test_the_image_runs_as_a_non_root_user_that_owns_the_data_directory():
    instructions = dockerfile_instructions()
    users = [args for instruction, args in instructions if instruction == "USER"]
    assert users, "the Dockerfile never leaves root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")
    assert any(instruction == "RUN" and re.search(rf"chown\s+{re.escape(user)}\S*\s+/data\b", args)
               for instruction, args in instructions)
    assert dockerfile_env()["STATEKEEPER_DATA_DIR"] == "/data"


def test_the_image_runs_make_serve_s_steps():
    """`make serve` is `make setup` (scripts/setup.sh) and then its recipe's command: the image runs the
    same target and the same command, so `make test` (which runs setup.sh too) covers the image's setup."""
    instructions = dockerfile_instructions()
    makefile = (REPO / "Makefile").read_text()
    py = re.search(r"^PY\s*:=\s*(\S+)", makefile, re.M).group(1)
    serve = re.search(r"^serve:\s*(.*)\n\t(.+)$", makefile, re.M)
    assert serve.group(1).split() == ["setup"]
    recipe = shlex.split(serve.group(2).replace("$(PY)", py).replace("$(ARGS)", ""))
    assert re.search(r"^setup:.*\n\tbash scripts/setup.sh$", makefile, re.M)
    assert ("RUN", "make setup") in instructions
    cmd = [args for instruction, args in instructions if instruction == "CMD"][-1]
    assert json.loads(cmd) == recipe


def test_redis_requires_the_password_statekeeper_sends_and_is_not_published(config):
    redis = config["services"]["redis"]
    env = config["services"]["statekeeper"]["environment"]
    password = env["STATEKEEPER_REDIS_PASSWORD"]
    command = redis["command"]
    assert command[command.index("--requirepass") + 1] == password
    assert redis["environment"]["REDISCLI_AUTH"] == password  # the healthcheck's redis-cli logs in
    assert "ports" not in redis
    assert env["STATEKEEPER_REDIS_URL"].startswith("redis://redis:")


def test_every_statekeeper_variable_compose_sets_is_a_setting(monitoring, scale):
    fields = set(Settings.model_fields)
    names = {name for profile in (monitoring, scale) for service in profile["services"].values()
             for name in service.get("environment", {}) if name.startswith("STATEKEEPER_")}
    names |= {line.split("=", 1)[0] for line in ENV_EXAMPLE.read_text().splitlines()
              if line.startswith("STATEKEEPER_")}
    names |= {name for name in dockerfile_env() if name.startswith("STATEKEEPER_")}
    unknown = sorted(name for name in names if name.removeprefix("STATEKEEPER_").lower() not in fields)
    assert not unknown, f"not settings (statekeeper.settings.Settings): {unknown}"


def test_the_compose_environment_is_a_valid_production_configuration(config, monkeypatch):
    """What the container sees (the image's ENV, then compose's environment) builds the service's config."""
    import os

    for name in list(os.environ):
        if name.startswith("STATEKEEPER_"):
            monkeypatch.delenv(name)
    environment = {**dockerfile_env(), **config["services"]["statekeeper"]["environment"]}
    for name, value in environment.items():
        monkeypatch.setenv(name, str(value))
    settings = Settings(_env_file=None)
    assert settings.environment == "production"
    service = settings.to_config()
    assert service.admin_token and service.auth == "api_key" and not service.metrics_public
    redis = [tier for tier in service.tiers if tier.name == "redis"]
    assert redis and redis[0].password == environment["STATEKEEPER_REDIS_PASSWORD"]
    assert redis[0].secret and service.index_secret
    assert settings.host == "0.0.0.0" and str(settings.data_dir) == "/data"
    statekeeper = config["services"]["statekeeper"]
    published = [port["target"] if isinstance(port, dict) else int(str(port).split(":")[-1].split("/")[0])
                 for port in statekeeper["ports"]]
    assert settings.port in published


def test_prometheus_scrapes_metrics_with_the_admin_token(monitoring):
    prometheus = monitoring["services"]["prometheus"]
    scrape = yaml.safe_load(PROMETHEUS.read_text())
    [job] = [job for job in scrape["scrape_configs"] if job["job_name"] == "statekeeper"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [target for group in job["static_configs"] for target in group["targets"]]
    statekeeper_env = monitoring["services"]["statekeeper"]["environment"]
    assert targets == [f"statekeeper:{statekeeper_env.get('STATEKEEPER_PORT', 8000)}"]
    # The bearer token: a file on the container's tmpfs, written at start from the same admin token.
    token_file = job["authorization"]["credentials_file"]
    assert job["authorization"].get("type", "Bearer") == "Bearer"
    assert any(token_file.startswith(mount.rstrip("/") + "/") for mount in prometheus["tmpfs"])
    entrypoint = " ".join(prometheus["entrypoint"])
    assert f"> {token_file}" in entrypoint and "STATEKEEPER_ADMIN_TOKEN" in entrypoint
    assert prometheus["environment"]["STATEKEEPER_ADMIN_TOKEN"] == statekeeper_env["STATEKEEPER_ADMIN_TOKEN"]
    config_file = re.search(r"--config\.file=(\S+)", entrypoint).group(1)
    assert any(volume.split(":")[:2] == [str(PROMETHEUS), config_file] for volume in prometheus["volumes"])


def exported_names(make_service) -> set[str]:
    """Every sample name a service's /metrics can carry, from its own registry (a histogram's series exist
    only once a turn has been observed, so the families say what their samples will be called)."""
    service = make_service(tiers=("dram", "lmdb"))
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {family.name + suffix for family in service.metrics.registry.collect()
            for suffix in suffixes[family.type]}


def test_every_metric_on_the_grafana_dashboard_is_exported(make_service):
    names = exported_names(make_service)
    assert "statekeeper_turns_total" in names and "statekeeper_ttft_seconds_bucket" in names
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = {panel["title"]: [target["expr"] for target in panel["targets"]] for panel in dashboard["panels"]}
    used = set()
    for title, queries in exprs.items():
        found = {name for query in queries for name in re.findall(r"\bstatekeeper_[a-z0-9_]+", query)}
        assert found, f"panel {title!r} plots no statekeeper metric"
        used |= found
    assert not sorted(used - names), f"not exported by statekeeper/metrics.py: {sorted(used - names)}"
    titles = " | ".join(exprs).lower()
    for wanted in ("ttft p95", "turns/s", "hit rate", "budget", "compression ratio"):
        assert wanted in titles


def test_grafana_provisions_the_datasource_and_the_dashboard(monitoring):
    grafana = monitoring["services"]["grafana"]
    mounts = {volume.split(":")[1]: volume.split(":")[0] for volume in grafana["volumes"]}
    for folder in ("datasources", "dashboards"):
        assert Path(mounts[f"/etc/grafana/provisioning/{folder}"]) == GRAFANA / "provisioning" / folder
    [source] = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    [provider] = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "statekeeper.yml").read_text())["providers"]
    assert Path(mounts[provider["options"]["path"]]) == DASHBOARD.parent
    dashboard = json.loads(DASHBOARD.read_text())
    uids = {target["datasource"]["uid"] for panel in dashboard["panels"] for target in panel["targets"]}
    assert uids == {source["uid"]}
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"]  # never Grafana's admin/admin default


def test_the_real_env_file_stays_out_of_git_and_of_the_build_context():
    assert ".env" in (REPO / ".gitignore").read_text().splitlines()
    assert ".env" in (REPO / ".dockerignore").read_text().splitlines()


def test_the_scale_profile_runs_two_replicas_over_one_postgres_behind_nginx(scale, monkeypatch):
    """--profile scale (issue 18): each replica's environment is a valid production configuration with the
    PostgreSQL history and the Redis lease; the proxy waits for both and is the only one published."""
    import os

    services = scale["services"]
    assert {"postgres", "replica-a", "replica-b", "proxy"} <= set(services)
    assert all(services[name]["profiles"] == ["scale"] for name in ("postgres", "replica-a", "replica-b", "proxy"))
    assert services["proxy"]["image"].startswith("nginx:") and services["postgres"]["image"].startswith("postgres:")
    assert "pg_isready" in " ".join(services["postgres"]["healthcheck"]["test"])
    assert "ports" not in services["postgres"] and "ports" not in services["replica-a"]
    assert {name: dep["condition"] for name, dep in services["proxy"]["depends_on"].items()} == {
        "replica-a": "service_healthy", "replica-b": "service_healthy"}
    volumes = [services[name]["volumes"][0].split(":")[0] for name in ("replica-a", "replica-b")]
    assert len(set(volumes)) == 2  # each replica its own local tiers
    for name in ("replica-a", "replica-b"):
        for variable in list(os.environ):
            if variable.startswith("STATEKEEPER_"):
                monkeypatch.delenv(variable)
        for variable, value in {**dockerfile_env(), **services[name]["environment"]}.items():
            monkeypatch.setenv(variable, str(value))
        service = Settings(_env_file=None).to_config()
        assert service.history.backend == "postgres" and service.lease is not None
        assert f":{services['postgres']['environment']['POSTGRES_PASSWORD']}@postgres:" in service.history.postgres_dsn
        assert service.lease.password == services["redis"]["environment"]["REDISCLI_AUTH"]
        assert services[name]["depends_on"]["postgres"]["condition"] == "service_healthy"
    nginx = (REPO / "docker" / "nginx" / "scale.conf").read_text()
    assert "server replica-a:8000" in nginx and "server replica-b:8000" in nginx
    # A conversation's turns go to one replica (tests/e2e/test_scale_proxy.py runs it in a real nginx).
    assert "hash $statekeeper_conversation consistent;" in nginx
    assert any(volume.startswith(str(REPO / "docker" / "nginx" / "scale.conf") + ":") for volume in
               services["proxy"]["volumes"])
