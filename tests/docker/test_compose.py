"""docker-compose.yml works as written (issue 16), checked without a Docker engine: Debian's docker-compose
(scripts/install-test-deps.sh) resolves it with the checked-in example env file, and the resolved services
are held to what they must be: statekeeper healthy on /healthz, non-root, waiting for a password-protected
and healthy Redis, its environment a valid production configuration of statekeeper.settings; Prometheus
scrapes /metrics with the admin token, and every metric the Grafana dashboard plots is one the service
exports. The image's steps are `make serve`'s, so the tests that run `make test` cover what the image runs.

Production hardening (issue 28, defect 9): every service without capabilities, privilege gain or a writable
root filesystem, non-root and memory-limited; no secret on a command line (Redis reads its password from a
config file that docker/redis/entrypoint.sh writes, run here against a real redis-server); the base image
pinned by digest; the image's `make setup` without pyproject's [test] extras while `make test` and `make
serve` keep them (scripts/setup.sh run in a sandbox with a stub pip that records what it is asked)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import time
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
REDIS_ENTRYPOINT = REPO / "docker" / "redis" / "entrypoint.sh"
MiB = 1 << 20


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


@pytest.fixture(scope="module")
def everything() -> dict:
    """Every service of every profile."""
    return resolved("monitoring", "scale")


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
    # docker/redis/entrypoint.sh writes it into redis.conf as requirepass (run for real below), and the
    # healthcheck's redis-cli logs in with it.
    assert redis["environment"]["REDISCLI_AUTH"] == password
    assert redis_entrypoint_script(redis) == REDIS_ENTRYPOINT
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


def test_prometheus_scrapes_metrics_with_the_metrics_token_not_the_admin_token(monitoring):
    prometheus = monitoring["services"]["prometheus"]
    scrape = yaml.safe_load(PROMETHEUS.read_text())
    [job] = [job for job in scrape["scrape_configs"] if job["job_name"] == "statekeeper"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [target for group in job["static_configs"] for target in group["targets"]]
    statekeeper_env = monitoring["services"]["statekeeper"]["environment"]
    assert targets == [f"statekeeper:{statekeeper_env.get('STATEKEEPER_PORT', 8000)}"]
    # The bearer token: a file on the container's tmpfs, written at start from the metrics token, which
    # reads /metrics and nothing else; the admin token, which can mint API keys, is not in Prometheus.
    token_file = job["authorization"]["credentials_file"]
    assert job["authorization"].get("type", "Bearer") == "Bearer"
    assert any(token_file.startswith(mount.rstrip("/") + "/") for mount in prometheus["tmpfs"])
    entrypoint = " ".join(prometheus["entrypoint"])
    assert f"> {token_file}" in entrypoint and "STATEKEEPER_METRICS_TOKEN" in entrypoint
    assert prometheus["environment"]["STATEKEEPER_METRICS_TOKEN"] == statekeeper_env["STATEKEEPER_METRICS_TOKEN"]
    assert "STATEKEEPER_ADMIN_TOKEN" not in prometheus["environment"] and "ADMIN" not in entrypoint
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


# -- production hardening (issue 28, defect 9) ------------------------------------------------------------

# Every service compose runs is long-running; these are the ones that must be there.
LONG_RUNNING = {"statekeeper", "redis", "postgres", "replica-a", "replica-b", "proxy", "prometheus", "grafana"}
# Images whose own USER is root: compose must name their unprivileged user (prom/prometheus runs as
# nobody, grafana/grafana as grafana, statekeeper's image as statekeeper: see the Dockerfile test above).
ROOT_IMAGES = ("redis:", "postgres:", "nginx:")
# What each service writes outside its volumes: a tmpfs each, the root filesystem being read-only.
WRITABLE = {"statekeeper": {"/tmp"}, "replica-a": {"/tmp"}, "replica-b": {"/tmp"}, "redis": {"/run/redis"},
            "postgres": {"/var/run/postgresql"}, "proxy": {"/var/cache/nginx", "/run"},
            "prometheus": {"/run/statekeeper"}, "grafana": {"/tmp", "/var/log/grafana"}}
VOLUMES = {"statekeeper": "/data", "replica-a": "/data", "replica-b": "/data", "postgres": "/var/lib/postgresql/data",
           "prometheus": "/prometheus", "grafana": "/var/lib/grafana"}


def example_env() -> dict[str, str]:
    return dict(line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines()
                if line.strip() and not line.startswith("#"))


def command_line_arguments(service: dict) -> list[str]:
    """What a container's processes get as arguments: its entrypoint, command and healthcheck."""
    arguments = []
    for value in (service.get("entrypoint"), service.get("command"), service.get("healthcheck", {}).get("test")):
        arguments += [value] if isinstance(value, str) else list(value or [])
    return [str(argument) for argument in arguments]


def memory_bytes(value) -> int:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([bkmg]?)b?", str(value).strip().lower())
    assert match, f"not a memory size: {value!r}"
    return int(float(match.group(1)) * {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[match.group(2)])


def test_no_secret_is_on_any_command_line(everything):
    """`docker inspect` shows a container's Cmd and Args to anyone who may use docker, and `ps` on the host
    shows its processes' arguments to every user: secrets reach the containers as environment only."""
    secrets = {name: value for name, value in example_env().items()
               if "TOKEN" in name or "SECRET" in name or "PASSWORD" in name}
    assert "STATEKEEPER_REDIS_PASSWORD" in secrets
    for name, service in everything["services"].items():
        arguments = "\n".join(command_line_arguments(service))
        leaked = sorted(secret for secret, value in secrets.items() if value in arguments)
        assert not leaked, f"{name}'s command line carries {leaked}"


def test_every_service_drops_capabilities_privileges_and_its_writable_root(everything):
    services = everything["services"]
    assert LONG_RUNNING <= set(services)
    for name, service in services.items():
        assert service.get("cap_drop") == ["ALL"] and not service.get("cap_add"), name
        assert "no-new-privileges:true" in service.get("security_opt", []), name
        assert service.get("read_only") is True and not service.get("privileged"), name
        assert memory_bytes(service.get("mem_limit", 0)) > 0, f"{name} has no memory limit"
        user = str(service.get("user", "")).split(":")[0]
        assert user not in ("root", "0"), name
        if service.get("image", "").startswith(ROOT_IMAGES):
            assert user, f"{name}'s image starts as root: run it as its unprivileged user"
        tmpfs = {mount.split(":")[0] for mount in service.get("tmpfs", [])}
        assert WRITABLE[name] <= tmpfs, f"{name} needs a tmpfs on {sorted(WRITABLE[name] - tmpfs)}"
        if name in VOLUMES:
            assert any(volume.split(":")[1] == VOLUMES[name] and not volume.endswith(":ro")
                       for volume in service["volumes"]), f"{name}'s data volume is gone or read-only"


def test_memory_limits_hold_what_each_service_keeps(everything):
    services = everything["services"]
    defaults = Settings.model_fields
    for name in ("statekeeper", "replica-a", "replica-b"):
        env = services[name]["environment"]
        kv_mb = sum(int(env.get(f"STATEKEEPER_{field.upper()}", defaults[field].default))
                    for field in ("active_kv_budget_mb", "dram_budget_mb"))
        # The model and torch, twice (the compression process has its own copy): 2.7 GB measured, no KV yet.
        assert memory_bytes(services[name]["mem_limit"]) >= kv_mb * MiB + (3 << 30), name
    redis = services["redis"]
    budget_mb = int(redis["environment"]["STATEKEEPER_REDIS_BUDGET_MB"])
    assert budget_mb == int(services["statekeeper"]["environment"]["STATEKEEPER_REDIS_BUDGET_MB"])
    maxmemory = budget_mb * MiB  # docker/redis/entrypoint.sh (checked below on a real Redis)
    assert memory_bytes(redis["mem_limit"]) >= maxmemory + 512 * MiB  # the allocator's and clients' headroom


def dockerfile_base_images() -> list[str]:
    """Each FROM's image, the ARGs declared before the first FROM replaced by their defaults."""
    args, images = {}, []
    for instruction, arguments in dockerfile_instructions():
        if instruction == "ARG" and not images:
            name, _, default = arguments.partition("=")
            args[name.strip()] = "".join(shlex.split(default))
        elif instruction == "FROM":
            image = next(word for word in arguments.split() if not word.startswith("--"))
            images.append(re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], image))
    return images


def test_the_base_image_is_pinned_by_digest():
    images = dockerfile_base_images()
    assert images
    for image in images:
        assert re.fullmatch(r"[a-z0-9._/-]+:[\w.-]+@sha256:[0-9a-f]{64}", image), f"not pinned by digest: {image}"


def dockerfile_run_environment(command: str) -> dict[str, str]:
    """What the final stage's `RUN <command>` gets from the Dockerfile: its ARGs' defaults and ENVs so far."""
    env: dict[str, str] = {}
    for instruction, arguments in dockerfile_instructions():
        if instruction == "FROM":
            env = {}
        elif instruction == "ARG" and "=" in arguments:
            name, default = arguments.split("=", 1)
            env[name.strip()] = "".join(shlex.split(default))
        elif instruction == "ENV":
            env.update(pair.split("=", 1) for pair in shlex.split(arguments))
        elif instruction == "RUN" and arguments == command:
            return env
    raise AssertionError(f"the Dockerfile has no RUN {command}")


@pytest.fixture
def setup_sandbox(tmp_path):
    """A copy of what `make setup` reads (Makefile, pyproject.toml, scripts/setup.sh) with a .venv whose pip
    records what it is asked to install and does nothing; run(target, **env) runs `make target` there and
    returns the packages each `pip install -e` was given (install-test-deps.sh and python are stubs too)."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    for name in ("Makefile", "pyproject.toml", "scripts/setup.sh"):
        shutil.copy(REPO / name, root / name)
    (root / "scripts" / "install-test-deps.sh").write_text("exit 0\n")
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    log = tmp_path / "pip.log"
    for name, body in (("python", "exit 0"), ("pip", f'echo "$*" >> {shlex.quote(str(log))}')):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    (bin_dir / "activate").write_text(f"PATH={shlex.quote(str(bin_dir))}:\"$PATH\"\nexport PATH\n")

    def run(target: str, **env: str) -> list[str]:
        log.unlink(missing_ok=True)
        environment = {name: value for name, value in os.environ.items()
                       if name not in ("STATEKEEPER_EXTRAS", "MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
        result = subprocess.run(["make", "-s", target], cwd=root, env={**environment, **env}, capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        calls = log.read_text().splitlines() if log.exists() else []
        return [shlex.split(call)[shlex.split(call).index("-e") + 1] for call in calls if "-e" in shlex.split(call)]

    run.stamp = root / ".venv" / ".statekeeper-installed"
    return run


def test_the_image_installs_statekeeper_without_the_test_extras(setup_sandbox):
    """The Dockerfile's `RUN make setup`, with the ARGs and ENVs it sees there, installs `-e .`: no pytest,
    Playwright or schemathesis in the production image."""
    env = dockerfile_run_environment("make setup")
    assert env.get("STATEKEEPER_EXTRAS") == ""
    assert setup_sandbox("setup", **env) == ["."]


def test_make_serve_and_make_test_still_install_the_test_extras(setup_sandbox):
    assert setup_sandbox("serve") == [".[test]"]
    setup_sandbox.stamp.unlink()
    # `make test` needs them whatever the caller's environment says.
    assert setup_sandbox("test", STATEKEEPER_EXTRAS="") == [".[test]"]


def test_the_setup_stamp_records_the_extras_so_switching_installs_again(setup_sandbox):
    assert setup_sandbox("setup") == [".[test]"]
    developer = setup_sandbox.stamp.read_text()
    assert setup_sandbox("setup") == []  # done: only checked
    assert setup_sandbox("setup", STATEKEEPER_EXTRAS="") == ["."]
    assert setup_sandbox.stamp.read_text() != developer
    assert setup_sandbox("setup", STATEKEEPER_EXTRAS="") == []
    assert setup_sandbox("test") == [".[test]"]
    assert setup_sandbox.stamp.read_text() == developer


def redis_entrypoint_script(redis_service: dict) -> Path:
    """The host file the redis service's entrypoint runs, bind-mounted read-only."""
    shell, script = redis_service["entrypoint"]
    assert shell == "/bin/sh"
    [volume] = [volume.split(":") for volume in redis_service["volumes"] if volume.split(":")[1] == script]
    assert volume[2:] == ["ro"]
    return Path(volume[0])


def test_redis_gets_its_password_from_a_config_file_never_from_its_arguments(config, tmp_path):
    """docker/redis/entrypoint.sh as compose runs it, on a real redis-server: the password (quotes,
    backslashes and all) works and nothing else does, and neither Redis' arguments nor its environment
    carry it; the config file, on the service's tmpfs in compose, is its owner's only."""
    import redis

    from benchmarks.harness.redis_server import free_port

    if shutil.which("redis-server") is None:
        raise RuntimeError("redis-server is not installed: run scripts/install-test-deps.sh")
    service = config["services"]["redis"]
    assert "/run/redis" in {mount.split(":")[0] for mount in service["tmpfs"]}  # the script's default
    password = "pa ss\"wo\\rd' $HOME `id` %s \\x41"
    budget_mb = int(service["environment"]["STATEKEEPER_REDIS_BUDGET_MB"])
    port = free_port()
    env = {"PATH": os.environ["PATH"], "REDISCLI_AUTH": password, "REDIS_CONFIG_DIR": str(tmp_path),
           "STATEKEEPER_REDIS_BUDGET_MB": str(budget_mb)}
    command = [*service["entrypoint"], *service["command"], "--port", str(port), "--bind", "127.0.0.1",
               "--logfile", str(tmp_path / "redis.log")]
    command[1] = str(redis_entrypoint_script(service))
    process = subprocess.Popen(command, env=env, cwd=tmp_path)
    try:
        client = redis.Redis(port=port, password=password, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                assert client.ping()
                break
            except redis.ConnectionError:
                assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "redis.log").read_text()
                time.sleep(0.05)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).set("statekeeper:probe", b"x")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, password=password[:-1]).ping()
        config_file = tmp_path / "redis.conf"
        assert client.info("server")["config_file"] == str(config_file)
        assert stat.S_IMODE(config_file.stat().st_mode) == 0o600
        assert client.config_get("maxmemory")["maxmemory"] == str(budget_mb * MiB)  # the shared budget
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "allkeys-lru"  # any replica's blobs
        assert client.config_get("save")["save"] == "" and client.config_get("appendonly")["appendonly"] == "no"
        # The shell exec'd redis-server: this process is Redis itself.
        arguments = Path(f"/proc/{process.pid}/cmdline").read_bytes()
        assert b"redis-server" in arguments
        assert password.encode() not in arguments
        assert password.encode() not in Path(f"/proc/{process.pid}/environ").read_bytes()
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.mark.parametrize("password", [None, "", "two\nlines"])
def test_the_redis_entrypoint_refuses_a_missing_or_multiline_password(tmp_path, password):
    env = {"PATH": os.environ["PATH"], "REDIS_CONFIG_DIR": str(tmp_path)}
    if password is not None:
        env["REDISCLI_AUTH"] = password
    result = subprocess.run(["/bin/sh", str(REDIS_ENTRYPOINT), "--port", "0"], env=env, capture_output=True,
                            text=True, timeout=10)
    assert result.returncode != 0 and "password" in result.stderr.lower()
    assert not (tmp_path / "redis.conf").exists()


def test_each_statekeeper_container_may_take_its_drain_and_its_shutdown_before_it_is_killed(everything):
    """A stop drains requests under way (DRAIN_SECONDS), then stores the active KV (SHUTDOWN_SECONDS): Docker's
    default 10 s before SIGKILL cut that short, and every active state was recomputed after the restart."""
    from statekeeper.settings import Settings

    defaults = Settings.model_fields
    needed = defaults["drain_seconds"].default + defaults["shutdown_seconds"].default
    for name in ("statekeeper", "replica-a", "replica-b"):
        service = everything["services"][name]
        environment = service.get("environment") or {}
        drain = float(environment.get("STATEKEEPER_DRAIN_SECONDS", defaults["drain_seconds"].default))
        store = float(environment.get("STATEKEEPER_SHUTDOWN_SECONDS", defaults["shutdown_seconds"].default))
        grace = service.get("stop_grace_period")
        assert grace is not None, f"{name} is killed 10 s after its stop signal"
        seconds = float(str(grace).rstrip("s")) if not isinstance(grace, (int, float)) else grace / 1e9
        assert seconds >= drain + store + 2 >= needed, name


def test_the_proxy_lets_go_of_an_idle_replica_connection_before_the_replica_does():
    """nginx kept idle upstream connections 60 s (its default) where uvicorn closes them after 5 s: a turn sent on
    one that uvicorn was closing got a 502, and nginx does not retry a POST it had sent."""
    import re

    import uvicorn

    nginx = (REPO / "docker" / "nginx" / "scale.conf").read_text()
    upstream = nginx.split("upstream statekeeper {")[1].split("}")[0]
    found = re.search(r"keepalive_timeout\s+(\d+)s;", upstream)
    assert found is not None, "the upstream's idle connections are kept nginx's default 60 s"
    assert int(found.group(1)) < uvicorn.Config(app=None).timeout_keep_alive
