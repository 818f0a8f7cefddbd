#!/usr/bin/env bash
# Installs (if missing) and starts (if stopped) the services the test suite needs: PostgreSQL 15 and
# RabbitMQ, both on loopback. Meant for a fresh Debian 12 machine run as root, without systemd.
# Safe to run any number of times: each step checks before it acts. Exits non-zero with a clear
# message when a service cannot be made ready.
set -euo pipefail

PG_VERSION="${EXACTLYONCE_PG_VERSION:-15}"
PG_CLUSTER="${EXACTLYONCE_PG_CLUSTER:-main}"
PG_PASSWORD="${EXACTLYONCE_PG_PASSWORD:-postgres}"
READY_TIMEOUT="${EXACTLYONCE_READY_TIMEOUT:-120}"

log()  { printf '[services] %s\n' "$*"; }
fail() { printf '[services] ERROR: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || fail "run as root (it installs packages with apt-get and starts services)"

apt_updated=0
apt_install() {
  if [ "$apt_updated" -eq 0 ]; then
    log "apt-get update"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq || fail "apt-get update failed"
    apt_updated=1
  fi
  log "installing $*"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null \
    || fail "apt-get install $* failed"
}

# ---- PostgreSQL -------------------------------------------------------------------------------
if ! command -v pg_ctlcluster >/dev/null 2>&1 || [ ! -x "/usr/lib/postgresql/${PG_VERSION}/bin/postgres" ]; then
  apt_install "postgresql-${PG_VERSION}" postgresql-client-common
fi
if ! pg_lsclusters -h 2>/dev/null | awk '{print $1" "$2}' | grep -qx "${PG_VERSION} ${PG_CLUSTER}"; then
  log "creating PostgreSQL cluster ${PG_VERSION}/${PG_CLUSTER}"
  pg_createcluster "${PG_VERSION}" "${PG_CLUSTER}" >/dev/null || fail "pg_createcluster failed"
fi

pg_running() { pg_lsclusters -h | awk -v v="$PG_VERSION" -v c="$PG_CLUSTER" '$1==v && $2==c {print $4}' | grep -q online; }
start_pg() {
  if ! pg_running; then
    log "starting PostgreSQL ${PG_VERSION}/${PG_CLUSTER}"
    pg_ctlcluster --skip-systemctl-redirect "${PG_VERSION}" "${PG_CLUSTER}" start \
      || fail "PostgreSQL did not start; see /var/log/postgresql/postgresql-${PG_VERSION}-${PG_CLUSTER}.log"
  fi
}
start_pg

psql_admin() { su postgres -c "psql -X -q -t -A -v ON_ERROR_STOP=1 -c \"$1\"" ; }
deadline=$((SECONDS + READY_TIMEOUT))
until su postgres -c "pg_isready -q -h 127.0.0.1 -p 5432" ; do
  [ $SECONDS -lt $deadline ] || fail "PostgreSQL not accepting connections on 127.0.0.1:5432 after ${READY_TIMEOUT}s"
  sleep 1
done

# Tests open many concurrent consumers (several buses x concurrency); the default of 100 connections is tight.
restart_needed=0
if [ "$(psql_admin 'SHOW max_connections')" -lt 300 ]; then
  psql_admin "ALTER SYSTEM SET max_connections = 300" >/dev/null
  restart_needed=1
fi
if [ "$restart_needed" -eq 1 ]; then
  log "restarting PostgreSQL to apply max_connections"
  pg_ctlcluster --skip-systemctl-redirect "${PG_VERSION}" "${PG_CLUSTER}" restart || fail "PostgreSQL restart failed"
  deadline=$((SECONDS + READY_TIMEOUT))
  until su postgres -c "pg_isready -q -h 127.0.0.1 -p 5432" ; do
    [ $SECONDS -lt $deadline ] || fail "PostgreSQL not ready after restart"
    sleep 1
  done
fi
# The password is set through stdin so it never appears in a process list or a log.
printf "ALTER USER postgres PASSWORD '%s';\n" "$PG_PASSWORD" | su postgres -c "psql -X -q -v ON_ERROR_STOP=1" >/dev/null \
  || fail "could not set the postgres user's password"
log "PostgreSQL ready on 127.0.0.1:5432"

# ---- RabbitMQ ---------------------------------------------------------------------------------
if ! command -v rabbitmq-server >/dev/null 2>&1; then
  apt_install rabbitmq-server
fi
# A fixed node name (read by both rabbitmq-server and rabbitmqctl) makes the node independent of how
# this machine's hostname resolves; AMQP listens on loopback only.
mkdir -p /etc/rabbitmq
if ! grep -qs '^NODENAME=' /etc/rabbitmq/rabbitmq-env.conf; then
  printf 'NODENAME=rabbit@localhost\n' >> /etc/rabbitmq/rabbitmq-env.conf
fi
if ! grep -qs '^listeners.tcp.default' /etc/rabbitmq/rabbitmq.conf; then
  printf 'listeners.tcp.default = 127.0.0.1:5672\n' >> /etc/rabbitmq/rabbitmq.conf
fi
rabbit_ok() { timeout 20 rabbitmqctl -q status >/dev/null 2>&1; }
if ! rabbit_ok; then
  log "starting RabbitMQ"
  rabbitmq-server -detached >/dev/null 2>&1 || true
fi
# await_startup returns at once while the node is still booting and not yet reachable: poll it.
deadline=$((SECONDS + READY_TIMEOUT))
until timeout 30 rabbitmqctl -q await_startup >/dev/null 2>&1; do
  [ $SECONDS -lt $deadline ] || fail "RabbitMQ did not become ready within ${READY_TIMEOUT}s; see /var/log/rabbitmq/"
  sleep 1
done
log "RabbitMQ ready on 127.0.0.1:5672"
