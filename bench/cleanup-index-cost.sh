#!/usr/bin/env bash
# Measures what the retention index (ix_inbox_messages_processed_at) costs on the inbox hot path: one claim per
# transaction (INSERT ... ON CONFLICT DO NOTHING, the row written already processed, as the inbox does since
# 2026-11-30), 8 clients, with and without the index, alternating runs on an emptied table. Prints each run's tps, then median and spread per variant.
# Needs eng/services.sh to have run (PostgreSQL on 127.0.0.1:5432, postgres/postgres).
set -euo pipefail
RUNS="${RUNS:-5}" SECONDS_PER_RUN="${SECONDS_PER_RUN:-15}" CLIENTS="${CLIENTS:-8}"
source "$(dirname "$0")/pgbench-common.sh"
create_inbox_database eo_index_cost
script=$(mktemp)
cat > "$script" <<'SQL'
SELECT quote_literal(gen_random_uuid()) AS u \gset
BEGIN;
INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at) VALUES (:u::uuid, 'bench', now(), now()) ON CONFLICT (id, consumer_type) DO NOTHING;
COMMIT;
SQL
declare -A results=()
for run in $(seq 1 "$RUNS"); do
  for variant in without with; do
    psql -d eo_index_cost -c "TRUNCATE inbox_messages" -c "DROP INDEX IF EXISTS ix_inbox_messages_processed_at" >/dev/null
    if [ "$variant" = with ]; then
      psql -d eo_index_cost -c "CREATE INDEX ix_inbox_messages_processed_at ON inbox_messages (processed_at) WHERE processed_at IS NOT NULL" >/dev/null
    fi
    tps=$("$PGBENCH" -h 127.0.0.1 -U postgres -n -f "$script" -c "$CLIENTS" -j 2 -T "$SECONDS_PER_RUN" eo_index_cost 2>/dev/null \
      | awk '/^tps/ {printf "%.0f", $3}')
    echo "run $run  $variant index: $tps tps"
    results[$variant]+="$tps "
  done
done
for variant in without with; do
  summarize "$variant index" ${results[$variant]}
done
psql -c "DROP DATABASE eo_index_cost" >/dev/null
rm -f "$script"
