#!/usr/bin/env bash
# The quick start's first command, from whatever state the machine is in: make sure PostgreSQL and RabbitMQ run on
# loopback (starting them, or as root on Debian/Ubuntu installing them first), then build and run `inboxctl demo`
# against them. Extra arguments go to the demo (e.g. --parcels 1000).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh >&2
exec cargo run --release -- demo "$@"
