#!/usr/bin/env bash
# The whole test suite, as CI runs it: make sure PostgreSQL and RabbitMQ are up, then run every test of the workspace
# against them (unit tests, integration tests, the crash tests with their failpoints compiled in, the bench's crate).
# Extra arguments go to nextest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh --for-tests
exec cargo nextest run --workspace --features inboxctl/failpoints --profile ci "$@"
