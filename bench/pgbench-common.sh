# Sourced by the pgbench scripts in bench/: the PostgreSQL of eng/services.sh (127.0.0.1:5432, postgres/postgres),
# a fresh database with the inbox table as the library creates it, and the median/spread summary of a variant's runs.
export PGPASSWORD="${PGPASSWORD:-postgres}" PGOPTIONS="${PGOPTIONS:--c client_min_messages=warning}" # no "does not exist, skipping"
PGBENCH=$(ls /usr/lib/postgresql/*/bin/pgbench | tail -1)
psql() { command psql -h 127.0.0.1 -U postgres -v ON_ERROR_STOP=1 -qAt "$@"; }

# $1: database name. Drops and creates it, with inbox_messages, its primary key and the unprocessed index.
create_inbox_database() {
  psql -c "DROP DATABASE IF EXISTS $1" -c "CREATE DATABASE $1" >/dev/null
  psql -d "$1" <<'SQL'
CREATE TABLE inbox_messages (id uuid NOT NULL, consumer_type varchar(500) NOT NULL, received_at timestamptz NOT NULL,
  processed_at timestamptz NULL, CONSTRAINT pk_inbox_messages PRIMARY KEY (id, consumer_type));
CREATE INDEX ix_inbox_messages_unprocessed ON inbox_messages (received_at) WHERE processed_at IS NULL;
SQL
}

# $1: label, then each run's tps. Prints "label: median N tps, min N, max N (n=N)".
summarize() {
  local label=$1; shift
  echo "$label: $(printf '%s\n' "$@" | sort -n | awk '{a[NR]=$1} END {printf "median %d tps, min %d, max %d (n=%d)", a[int((NR+1)/2)], a[1], a[NR], NR}')"
}
