#!/usr/bin/env bash
# Measures the inbox transaction's shapes in PostgreSQL alone (pgbench, no broker, no .NET), the figures behind two
# changes of 2026-11-30 (docs/performance.md, "What was cut"):
#   with-update        claim without processed_at · business insert · UPDATE processed_at · COMMIT (the shape until then)
#   claim-processed    claim writing processed_at · business insert · COMMIT (today's shape), extended protocol
#   claim-prepared     today's shape, every statement prepared (-M prepared)
# BEGIN and the claim's three statements go in one pipeline, as Npgsql sends them. Alternating runs on emptied tables;
# prints each run's tps, then median and spread per variant. Needs eng/services.sh to have run.
set -euo pipefail
RUNS="${RUNS:-3}" SECONDS_PER_RUN="${SECONDS_PER_RUN:-8}" CLIENTS="${CLIENTS:-16}"
source "$(dirname "$0")/pgbench-common.sh"
create_inbox_database eo_claim_shapes
psql -d eo_claim_shapes <<'SQL'
CREATE INDEX ix_inbox_messages_processed_at ON inbox_messages (processed_at) WHERE processed_at IS NOT NULL;
CREATE TABLE bench_rows (id bigserial PRIMARY KEY, key uuid NOT NULL, written_at timestamptz NOT NULL DEFAULT clock_timestamp());
SQL
dir=$(mktemp -d)
trap 'rm -rf "$dir"; psql -c "DROP DATABASE IF EXISTS eo_claim_shapes" >/dev/null' EXIT
claim() { # $1: the insert's extra column and value, or nothing
  cat <<SQL
\startpipeline
BEGIN;
SELECT set_config('lock_timeout', '30000ms', true);
INSERT INTO inbox_messages (id, consumer_type, received_at$1) VALUES (:u::uuid, 'bench', now()$2) ON CONFLICT (id, consumer_type) DO NOTHING RETURNING 1;
SET LOCAL lock_timeout TO DEFAULT;
\endpipeline
INSERT INTO bench_rows (key) VALUES (:u::uuid) RETURNING id, written_at;
SQL
}
{ echo 'SELECT gen_random_uuid() AS u \gset'; claim "" ""
  echo "UPDATE inbox_messages SET processed_at = now() WHERE id = :u::uuid AND consumer_type = 'bench';"; echo 'COMMIT;'; } > "$dir/with-update.sql"
{ echo 'SELECT gen_random_uuid() AS u \gset'; claim ", processed_at" ", now()"; echo 'COMMIT;'; } > "$dir/claim-processed.sql"
cp "$dir/claim-processed.sql" "$dir/claim-prepared.sql"
variants=(with-update claim-processed claim-prepared)
declare -A results=()
for run in $(seq 1 "$RUNS"); do
  for variant in "${variants[@]}"; do
    mode=extended; [ "$variant" = claim-prepared ] && mode=prepared
    psql -d eo_claim_shapes -c "TRUNCATE inbox_messages, bench_rows" >/dev/null
    tps=$("$PGBENCH" -h 127.0.0.1 -U postgres -n -M "$mode" -f "$dir/$variant.sql" -c "$CLIENTS" -j 2 -T "$SECONDS_PER_RUN" eo_claim_shapes 2>/dev/null \
      | awk '/^tps/ {printf "%.0f", $3}')
    echo "run $run  $variant: $tps tps"
    results[$variant]+="$tps "
  done
done
for variant in "${variants[@]}"; do
  summarize "$variant" ${results[$variant]}
done
