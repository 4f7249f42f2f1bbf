#!/usr/bin/env bash
# Test-only system packages: a real redis-server for the Redis tier tests and a real PostgreSQL for the
# shared history's (each started by the tests themselves on a free loopback port, PostgreSQL as a
# throwaway cluster in a temporary directory, tests/utils/postgres_server.py), docker-compose, whose
# `config` validates docker-compose.yml (tests/docker/test_compose.py; no Docker engine is needed), nginx,
# which runs the compose file's proxy config in front of two replicas (tests/e2e/test_scale_proxy.py, in
# the foreground in a temporary directory), and Debian's chromium for the dashboard's
# browser tests (Playwright drives it; `playwright install` is not used). Debian packages; needs root,
# as on CI.
set -euo pipefail

install_package() {  # $1: the package, if its command $2 is missing
    if ! command -v "$2" >/dev/null 2>&1; then
        if [ "$(id -u)" -ne 0 ]; then
            echo "$2 is missing: install Debian's $1 package (needs root)" >&2
            exit 1
        fi
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$1" >/dev/null
    fi
}

install_package redis-server redis-server
redis-server --version
# Debian puts initdb and pg_ctl under /usr/lib/postgresql/<version>/bin, off PATH: look there.
if ! command -v initdb >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    install_package postgresql initdb
fi
ls /usr/lib/postgresql/*/bin/postgres
install_package docker-compose docker-compose
docker-compose version --short
# Debian puts nginx in /usr/sbin, which may be off PATH (tests/utils/nginx_server.py looks there too).
if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; then
    install_package nginx nginx
fi
"$(command -v nginx || echo /usr/sbin/nginx)" -v
install_package chromium chromium
/usr/bin/chromium --version
