#!/usr/bin/env bash
# Test-only system packages: a real redis-server for the Redis tier tests (started by the tests
# themselves on a free loopback port), and docker-compose, whose `config` validates docker-compose.yml
# (tests/docker/test_compose.py; no Docker engine is needed). Debian packages; needs root, as on CI.
set -euo pipefail
if ! command -v redis-server >/dev/null 2>&1; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "redis-server is missing: install Debian's redis-server package (needs root)" >&2
        exit 1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null
fi
redis-server --version
if ! command -v docker-compose >/dev/null 2>&1; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "docker-compose is missing: install Debian's docker-compose package (needs root)" >&2
        exit 1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-compose >/dev/null
fi
docker-compose version --short
