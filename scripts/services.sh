#!/usr/bin/env bash
# Makes sure the services inboxctl's demo and tests use are up: PostgreSQL on 127.0.0.1:5432 and RabbitMQ on
# 127.0.0.1:5672. Installs them from Debian's packages if missing (as root), starts them if stopped, waits until they
# answer. With --for-tests, also the tools the test suite calls. Safe to run any number of times; changes nothing
# about a server that is already running.
set -euo pipefail

READY_TIMEOUT="${INBOXCTL_READY_TIMEOUT:-120}"
log()  { printf '[services] %s\n' "$*"; }
fail() { printf '[services] ERROR: %s\n' "$*" >&2; exit 1; }

apt_updated=0
apt_install() {
  [ "$(id -u)" -eq 0 ] || fail "$* is missing; install it (root is needed) or point INBOXCTL_TEST_PG / INBOXCTL_TEST_AMQP elsewhere"
  if [ "$apt_updated" -eq 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq || fail "apt-get update failed"
    apt_updated=1
  fi
  log "installing $*"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null || fail "apt-get install $* failed"
}

wait_for() { # description, command...
  local what=$1; shift
  local deadline=$((SECONDS + READY_TIMEOUT))
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || fail "$what not ready after ${READY_TIMEOUT}s"
    sleep 1
  done
}

# ---- PostgreSQL ----
command -v pg_ctlcluster >/dev/null 2>&1 || apt_install postgresql
if ! pg_isready -q -h 127.0.0.1 -p 5432; then
  version=$(ls /etc/postgresql | sort -V | tail -n 1)
  [ -n "$version" ] || fail "no PostgreSQL cluster in /etc/postgresql"
  log "starting PostgreSQL $version/main"
  pg_ctlcluster --skip-systemctl-redirect "$version" main start || fail "PostgreSQL did not start; see /var/log/postgresql/"
fi
wait_for "PostgreSQL on 127.0.0.1:5432" pg_isready -q -h 127.0.0.1 -p 5432
log "PostgreSQL ready on 127.0.0.1:5432"

# ---- RabbitMQ ----
command -v rabbitmq-server >/dev/null 2>&1 || apt_install rabbitmq-server
if ! timeout 20 rabbitmqctl -q status >/dev/null 2>&1; then
  log "starting RabbitMQ"
  rabbitmq-server -detached >/dev/null 2>&1 || true
fi
# await_startup returns at once while the node is still booting and not yet reachable: poll it.
wait_for "RabbitMQ" timeout 30 rabbitmqctl -q await_startup
# `consume --partitions` spreads a queue over partition queues with a consistent-hash exchange, from a plugin that
# ships with RabbitMQ; enabling it again is a no-op.
if ! rabbitmq-plugins -q is_enabled rabbitmq_consistent_hash_exchange >/dev/null 2>&1; then
  log "enabling RabbitMQ's consistent-hash exchange plugin"
  rabbitmq-plugins -q enable rabbitmq_consistent_hash_exchange >/dev/null || fail "could not enable rabbitmq_consistent_hash_exchange"
fi
log "RabbitMQ ready on 127.0.0.1:5672"

[ "${1:-}" = "--for-tests" ] || exit 0

# ---- tools the tests call ----
command -v psql >/dev/null 2>&1 || apt_install postgresql-client
command -v tmux >/dev/null 2>&1 || apt_install tmux
# The TLS tests make their certificate authority with openssl; the bench's peer mode runs under Node.js.
command -v openssl >/dev/null 2>&1 || apt_install openssl
{ command -v node && command -v npm; } >/dev/null 2>&1 || apt_install nodejs npm
# The metrics test checks /metrics with Prometheus' own checker, promtool, from Debian's prometheus package (the
# tests use nothing else of it).
command -v promtool >/dev/null 2>&1 || apt_install prometheus
# compose.yaml is validated (offline) by Debian's docker-compose; the manual page is rendered by man.
command -v docker-compose >/dev/null 2>&1 || apt_install docker-compose
command -v man >/dev/null 2>&1 || apt_install man-db
# A process's clock set apart from the database's (libfaketime), for the tests of times judged on the database's.
command -v faketime >/dev/null 2>&1 || apt_install faketime
# The pooler tests (tests/pgbouncer.rs) run a PgBouncer of their own, each on a port of its own, from Debian's package.
# The package's own service (127.0.0.1:6432) is not wanted: where installing it started it, it is stopped and kept from
# starting at boot. A PgBouncer the machine had before is left as it is.
if [ ! -x /usr/sbin/pgbouncer ] && ! command -v pgbouncer >/dev/null 2>&1; then
  apt_install pgbouncer
  if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
    systemctl disable --now pgbouncer >/dev/null 2>&1 || true
  else
    invoke-rc.d pgbouncer stop >/dev/null 2>&1 || true
    update-rc.d pgbouncer disable >/dev/null 2>&1 || true
  fi
fi
command -v cargo-nextest >/dev/null 2>&1 || cargo nextest --version >/dev/null 2>&1 || fail "cargo-nextest is missing (cargo install cargo-nextest)"
