#!/usr/bin/env python3
"""Runs a command (the bench, say) while sampling PostgreSQL's WAL counters once a second, then prints the WAL it
wrote grouped into stretches in which one bench scratch database committed (about one repeat of one mode: its warm-up,
throughput, latency and duplicate runs): seconds, commits, full-page images, WAL bytes and checkpoints.

    scripts/wal-during.py [--pg URL] [--samples FILE] -- COMMAND ARGS...

The bench's scratch databases are those whose name contains `_bench_` (not the prefilled templates). Needs psql and
PostgreSQL 14 or later (pg_stat_wal). Measured with it: docs/performance.md, "NewId on a plain table".
"""
import argparse
import subprocess
import sys
import threading
import time

QUERY = (
    "SELECT extract(epoch FROM now())::bigint, wal_records, wal_fpi, wal_bytes, "
    "(SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter), "
    "(SELECT string_agg(datname || ':' || xact_commit, ',') FROM pg_stat_database "
    "WHERE datname LIKE '%\\_bench\\_%' AND datname NOT LIKE '%prefill%' AND datname NOT LIKE '%\\_rows\\_%') "
    "FROM pg_stat_wal"
)


def sample(pg, out, stop):
    while not stop.is_set():
        row = subprocess.run(
            ["psql", pg, "-AtF", " ", "-c", QUERY], capture_output=True, text=True
        ).stdout.strip()
        if row:
            out.append(row)
        stop.wait(1.0)


def parse(line):
    parts = line.split()
    t, _records, fpi, wal_bytes, checkpoints = map(int, parts[:5])
    dbs = {}
    if len(parts) > 5:
        for kv in parts[5].split(","):
            name, commits = kv.rsplit(":", 1)
            dbs[name] = int(commits)
    return t, fpi, wal_bytes, checkpoints, dbs


def stretches(rows):
    """Consecutive seconds in which exactly one scratch database committed (more than 5 commits)."""
    current, acc = None, None
    for a, b in zip(rows, rows[1:]):
        grew = [k for k in b[4] if b[4][k] - a[4].get(k, b[4][k]) > 5]
        key = grew[0] if len(grew) == 1 else None
        if key != current:
            if current and acc:
                yield (current, *acc)
            current, acc = key, ([0, 0, 0, 0, 0] if key else None)
        if acc:
            acc[0] += 1
            acc[1] += b[4][key] - a[4].get(key, 0)
            acc[2] += b[1] - a[1]
            acc[3] += b[2] - a[2]
            acc[4] += b[3] - a[3]
    if current and acc:
        yield (current, *acc)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pg", default="postgres://postgres@127.0.0.1:5432/postgres")
    ap.add_argument("--samples", help="also write the raw samples here")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the command to run after --")
    rows, stop = [], threading.Event()
    sampler = threading.Thread(target=sample, args=(args.pg, rows, stop))
    sampler.start()
    try:
        code = subprocess.call(command)
    finally:
        stop.set()
        sampler.join()
    if args.samples:
        with open(args.samples, "w") as f:
            f.write("\n".join(rows) + "\n")
    for name, secs, commits, fpi, wal_bytes, checkpoints in stretches([parse(r) for r in rows]):
        if secs >= 3:
            print(
                f"{name:45s} {secs:4d}s commits {commits:7d} fpi {fpi:8d} wal {wal_bytes / 1e6:8.1f} MB  "
                f"{wal_bytes / secs / 1e6:6.1f} MB/s  checkpoints {checkpoints}"
            )
    sys.exit(code)


if __name__ == "__main__":
    main()
