#!/usr/bin/env bash
# How long `migrate --partitioned` holds the claims behind its swap's lock: a scratch database whose plain inbox holds
# 100,000 rows, a probe (pgbench, one client) inserting a claim 200 times a second, and the conversion run meanwhile.
# Prints the conversion's own figure (`held_ms`, from its log) and the longest a probe claim took (pgbench's
# per-transaction log, the rate limit's lag included). Run on a quiet machine, after `cargo build`:
#
#   scripts/conversion-lock.sh [interval] [inboxctl binary]     (default 1h: 241 partitions; target/debug/inboxctl)
set -euo pipefail
INTERVAL=${1:-1h}
BIN=${2:-target/debug/inboxctl}
DB=inboxctl_conversion_lock
PG=(-h "${PGHOST:-127.0.0.1}" -U "${PGUSER:-postgres}")
URL="postgres://${PGUSER:-postgres}@${PGHOST:-127.0.0.1}:5432/$DB"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"; psql -q "${PG[@]}" -c "DROP DATABASE IF EXISTS $DB" postgres >/dev/null 2>&1 || true' EXIT

psql -q "${PG[@]}" -c "DROP DATABASE IF EXISTS $DB" postgres
"$BIN" migrate --database-url "$URL" >/dev/null
psql -q "${PG[@]}" -c "INSERT INTO inbox_messages SELECT gen_random_uuid(), 'probe', now(), now() \
  FROM generate_series(1, 100000)" "$DB"
echo "INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at) \
  VALUES (gen_random_uuid(), 'probe', now(), now()) ON CONFLICT DO NOTHING;" > "$WORK/probe.sql"

(cd "$WORK" && pgbench -n "${PG[@]}" -c 1 -T 40 -R 200 -f probe.sql -l --log-prefix=latency "$DB" > pgbench.out 2>&1) &
PROBE=$!
sleep 5
RUST_LOG=info "$BIN" migrate --partitioned "$INTERVAL" --database-url "$URL" > "$WORK/migrate.log" 2>&1
wait "$PROBE"
echo "held: $(grep -o 'held_ms=[0-9]*' "$WORK/migrate.log")"
# pgbench's log: client, transaction, latency in µs, …
cat "$WORK"/latency.* | awk '{ if ($3 > m) m = $3; n++ } END { printf "probe: %d claims, the longest %.0f ms\n", n, m / 1000 }'
