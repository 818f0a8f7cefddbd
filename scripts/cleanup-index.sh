#!/usr/bin/env bash
# Measures what makes one cleanup batch cheap: the batch DELETE inboxctl sends, on ROWS inbox rows of 4 consumer_types
# spread over 14 days, of which the oldest ~0.3 % are past the cutoff (a cleanup that runs regularly), with no extra
# index, with (processed_at), and with (consumer_type, processed_at). Prints each variant's execution times.
# Uses (and drops) the database inboxctl_cleanup_index on the server of PG (default: the loopback server).
set -euo pipefail
PG="${PG:-postgres://postgres@127.0.0.1:5432}"
ROWS="${ROWS:-2000000}"
RUNS="${RUNS:-3}"
DB=inboxctl_cleanup_index
psql "$PG/postgres" -q -c "DROP DATABASE IF EXISTS $DB" -c "CREATE DATABASE $DB"
URL="$PG/$DB"
psql "$URL" -q <<SQL
CREATE TABLE inbox_messages (
    id UUID NOT NULL, consumer_type VARCHAR(500) NOT NULL, received_at TIMESTAMPTZ NOT NULL, processed_at TIMESTAMPTZ NULL,
    CONSTRAINT pk_inbox_messages PRIMARY KEY (id, consumer_type));
CREATE INDEX ix_inbox_messages_unprocessed ON inbox_messages (received_at) WHERE processed_at IS NULL;
INSERT INTO inbox_messages
SELECT gen_random_uuid(), 'consumer-' || (g % 4), t, t
FROM generate_series(1, $ROWS) g,
     LATERAL (SELECT now() - (g % 14) * interval '1 day' - (g % 86400) * interval '1 second' AS t) x;
VACUUM ANALYZE inbox_messages;
SQL
batch() {
  for _ in $(seq "$RUNS"); do
    psql "$URL" -q -At <<SQL | grep -o 'Execution Time: .*'
BEGIN;
EXPLAIN (ANALYZE, COSTS OFF) DELETE FROM inbox_messages WHERE ctid = ANY(ARRAY(
  SELECT ctid FROM inbox_messages WHERE consumer_type = 'consumer-1' AND processed_at < now() - interval '13 days 23 hours'
  LIMIT 5000 FOR UPDATE SKIP LOCKED));
ROLLBACK;
SQL
  done
}
echo "deletable rows: $(psql "$URL" -At -c "SELECT count(*) FROM inbox_messages WHERE processed_at < now() - interval '13 days 23 hours'") of $ROWS"
echo "no extra index:"; batch
psql "$URL" -q -c "CREATE INDEX ix_p ON inbox_messages (processed_at)"
echo "(processed_at):"; batch
psql "$URL" -q -c "DROP INDEX ix_p" -c "CREATE INDEX ix_cp ON inbox_messages (consumer_type, processed_at)"
echo "(consumer_type, processed_at):"; batch
psql "$PG/postgres" -q -c "DROP DATABASE $DB"
