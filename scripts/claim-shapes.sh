#!/usr/bin/env bash
# The claim's shapes at the database alone, with pgbench (PostgreSQL's own client; no broker, no consumer): the
# stand-in carrier's effect alone, and with the claim, each sent as inboxctl sends it — one statement, its own
# transaction — or between BEGIN and COMMIT; and the claim without its fingerprint row, to show that row's share.
# Prints transactions per second, per shape and round, the shapes alternating. Run on a quiet machine:
#
#   scripts/claim-shapes.sh [rounds] [seconds]     (default 2 rounds of 12 s; a scratch database, dropped after)
set -euo pipefail
ROUNDS=${1:-2}
SECONDS_EACH=${2:-12}
DB=inboxctl_claim_shapes
PG=(-h "${PGHOST:-127.0.0.1}" -U "${PGUSER:-postgres}")
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"; psql "${PG[@]}" -qd postgres -c "DROP DATABASE IF EXISTS $DB" >/dev/null' EXIT

psql "${PG[@]}" -qd postgres -c "DROP DATABASE IF EXISTS $DB" -c "CREATE DATABASE $DB" >/dev/null
for f in "$ROOT"/migrations/*.sql; do psql "${PG[@]}" -qd "$DB" -v ON_ERROR_STOP=1 -f "$f" >/dev/null; done

ID="lpad(to_hex(:n::bigint),32,'0')::uuid"
EFFECT="INSERT INTO carrier_reservations (parcel_id, slot_id, pickup_at, message_id, idempotency_key)"
VALUES="$ID, $ID, now(), $ID, $ID"
INBOX_ROW="claimed AS (INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at) VALUES ($ID, 'carrier', now(), now()) ON CONFLICT (id, consumer_type) DO NOTHING RETURNING 1)"
FINGERPRINT="fingerprint AS (INSERT INTO inboxctl_fingerprints (id, consumer_type, fingerprint) SELECT $ID, 'carrier', '\\x0102'::bytea FROM claimed ON CONFLICT (id, consumer_type) DO UPDATE SET fingerprint = EXCLUDED.fingerprint)"
CLAIM_ALONE="WITH $INBOX_ROW, $FINGERPRINT SELECT EXISTS (SELECT 1 FROM claimed);"
ONE="WITH $INBOX_ROW, $FINGERPRINT, effect AS ($EFFECT SELECT $VALUES FROM claimed) SELECT EXISTS (SELECT 1 FROM claimed);"
ONE_NO_FINGERPRINT="WITH $INBOX_ROW, effect AS ($EFFECT SELECT $VALUES FROM claimed) SELECT EXISTS (SELECT 1 FROM claimed);"
N='\set n random(1, 9000000000000000)'
printf '%s\n' "$N" "$EFFECT VALUES ($VALUES);" > "$WORK/bare-one-statement.sql"
printf '%s\n' "$N" "$ONE" > "$WORK/inbox-one-statement.sql"
printf '%s\n' "$N" "$ONE_NO_FINGERPRINT" > "$WORK/inbox-one-statement-no-fingerprint.sql"
printf '%s\n' "$N" 'BEGIN;' "$EFFECT VALUES ($VALUES);" 'COMMIT;' > "$WORK/bare-transaction.sql"
printf '%s\n' "$N" 'BEGIN;' "$CLAIM_ALONE" "$EFFECT VALUES ($VALUES);" 'COMMIT;' > "$WORK/inbox-transaction.sql"

for round in $(seq 1 "$ROUNDS"); do
  for shape in bare-one-statement inbox-one-statement inbox-one-statement-no-fingerprint bare-transaction inbox-transaction; do
    psql "${PG[@]}" -qd "$DB" -c 'TRUNCATE inbox_messages, inboxctl_fingerprints, carrier_reservations'
    tps=$(pgbench "${PG[@]}" -n -M prepared -c 16 -j 2 -T "$SECONDS_EACH" -f "$WORK/$shape.sql" "$DB" 2>&1 \
      | sed -n 's/^tps = \([0-9.]*\).*/\1/p')
    printf '%s\t%s\t%.0f\n' "$round" "$shape" "$tps"
  done
done
