#!/bin/sh
# docker-compose.yml's Redis: starts redis-server with its password in a config file, never on a command
# line (`docker inspect`'s Args, `ps` on the host and Redis' own INFO would all show it there).
#
#   REDISCLI_AUTH               the password (.env's STATEKEEPER_REDIS_PASSWORD); the healthcheck's
#                               redis-cli reads the same variable
#   STATEKEEPER_REDIS_BUDGET_MB the shared tier's budget, whichever replica writes: Redis' maxmemory, with
#                               allkeys-lru, so Redis itself evicts the least recently used blobs of any
#                               replica (each replica counts only what it wrote; a blob that lost a key
#                               reads as missing and its conversation recomputes). noeviction would leave a
#                               full Redis refusing every new blob until TTLs expire
#   REDIS_CONFIG_DIR            where the config is written (default /run/redis, a tmpfs: the root
#                               filesystem is read-only)
#
# Its arguments go to redis-server after the config file (compose's `command`: --save "" --appendonly no).
# The config file is the user's only (umask 077), and redis-server starts without REDISCLI_AUTH in its
# environment. printf is the shell's builtin, and sed reads the password on its standard input.
set -eu
password=${REDISCLI_AUTH:?set REDISCLI_AUTH (STATEKEEPER_REDIS_PASSWORD in .env) to the Redis password}
case $password in
    *'
'*) echo "the Redis password must be one line" >&2; exit 1 ;;
esac
budget_mb=${STATEKEEPER_REDIS_BUDGET_MB:-4096}
case $budget_mb in
    '' | *[!0-9]*) echo "STATEKEEPER_REDIS_BUDGET_MB=$budget_mb: a whole number of MiB" >&2; exit 1 ;;
esac
maxmemory_mb=$budget_mb
config_dir=${REDIS_CONFIG_DIR:-/run/redis}
# In a double-quoted string of redis.conf a backslash escapes the next character.
quoted=$(printf '%s' "$password" | sed -e 's/\\/\\\\/g' -e 's/"/\\"/g')
umask 077
{
    printf 'requirepass "%s"\n' "$quoted"
    printf 'maxmemory %smb\n' "$maxmemory_mb"
    printf 'maxmemory-policy allkeys-lru\n'
} > "$config_dir/redis.conf"
unset REDISCLI_AUTH password quoted
exec redis-server "$config_dir/redis.conf" "$@"
