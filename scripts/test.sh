#!/usr/bin/env bash
# The whole test suite, as CI runs it: make sure PostgreSQL and RabbitMQ are up, then run every test against them
# (unit tests, integration tests, the crash tests with their failpoints compiled in). Extra arguments go to nextest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh
exec cargo nextest run --features failpoints --profile ci "$@"
