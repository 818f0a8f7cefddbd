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
# -m:1 runs the test projects one after the other: on 2 cores, timing-sensitive tests (concurrency, crashes)
# should not compete with another test assembly for the CPU.
dotnet test ExactlyOnce.slnx -c "$configuration" --no-build --nologo -m:1 --logger "console;verbosity=normal" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e

# Sum the per-assembly summaries ("     Passed: 30", "     Failed: 1", "    Skipped: 0") into one closing line.
awk '/^ +Passed: +[0-9]+ *$/ {p += $2} /^ +Failed: +[0-9]+ *$/ {f += $2} /^ +Skipped: +[0-9]+ *$/ {s += $2}
     END {printf "tests: %d passed, %d failed, %d skipped\n", p, f, s}' "$log"
if [ "$status" -eq 0 ] && ! grep -Eq '^ +Passed: +[1-9]' "$log"; then
  echo "no test ran" >&2
  exit 1
fi
exit "$status"
