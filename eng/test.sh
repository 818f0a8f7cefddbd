#!/usr/bin/env bash
# The README's test command: makes PostgreSQL and RabbitMQ ready (installing them if needed), then builds and runs
# the whole test suite. Ends with one summary line "tests: N passed, N failed, N skipped".
set -euo pipefail
cd "$(dirname "$0")/.."
export DOTNET_CLI_TELEMETRY_OPTOUT=1 DOTNET_NOLOGO=1 DOTNET_SKIP_FIRST_TIME_EXPERIENCE=1

bash eng/services.sh

configuration="${CONFIGURATION:-Release}"
dotnet build ExactlyOnce.slnx -c "$configuration" -warnaserror -nologo -v minimal

log="$(mktemp)"
trap 'rm -f "$log"' EXIT
set +e
dotnet test ExactlyOnce.slnx -c "$configuration" --no-build --nologo --logger "console;verbosity=normal" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e

# Sum the per-assembly summaries ("Failed!  - Failed: 0, Passed: 22, Skipped: 0, ...") into one closing line.
summary=$(grep -Eo 'Failed: +[0-9]+, Passed: +[0-9]+, Skipped: +[0-9]+' "$log" \
  | awk -F'[:,]' '{f+=$2; p+=$4; s+=$6} END {printf "tests: %d passed, %d failed, %d skipped", p, f, s}')
echo "${summary:-tests: 0 passed, 0 failed}"
exit "$status"
