#!/usr/bin/env python3
"""Where a message's time goes: CPU per message of the consumer, PostgreSQL and RabbitMQ, per consume mode.

For each mode (bare, tutorial, inbox, inbox with the usual transaction, inbox batched) it pre-loads N messages into a queue of its own, runs the mode's
consumer until the queue is idle — inboxctl's consumer operation, as the bench runs it (`inboxctl-bench consume`,
the same for every mode but for what guards each message's work) — and reads the CPU time each party spent meanwhile:
  - the consumer: its own rusage (user + system);
  - PostgreSQL: every postgres process's CPU, plus what the postmaster collected from backends that exited;
  - RabbitMQ: the Erlang VM (beam.smp).
It also reports, from PostgreSQL's own counters, the transactions committed and the WAL written per message.
Run it on a quiet machine (nothing else measuring), with the release binaries built:

    cargo build --release --workspace && scripts/profile-message-path.py [--messages 20000]

Each mode gets a scratch database (inboxctl_profile_<mode>) and a vhost (inboxctl-profile) that it drops afterwards.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release", "inboxctl")
BENCH_BIN = os.path.join(ROOT, "target", "release", "inboxctl-bench")
CLK = os.sysconf("SC_CLK_TCK")
VHOST = "inboxctl-profile"
MODES = {
    "bare": ["--guard", "bare"],
    "tutorial": ["--guard", "lookup-first"],
    "inbox": ["--guard", "inbox"],
    "inbox-transaction": ["--guard", "inbox-transaction"],
    "inbox-batched": ["--guard", "inbox", "--batch-size", "32"],
}


def stat(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # fields[0] is the state (field 3): utime is field 14, stime 15, cutime 16, cstime 17.
    return [int(x) / CLK for x in fields[11:15]]


def procs(name):
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
            if comm == name or comm.startswith(name):
                out.append(int(pid))
        except OSError:
            pass
    return out


def cpu(name, with_children):
    total = 0.0
    for pid in procs(name):
        try:
            u, s, cu, cs = stat(pid)
        except OSError:
            continue
        total += u + s + ((cu + cs) if with_children else 0.0)
    return total


def psql(db, sql):
    return subprocess.run(
        ["psql", "-h", "127.0.0.1", "-U", "postgres", "-d", db, "-Atqc", sql],
        check=True, capture_output=True, text=True,
    ).stdout.strip()


def run(args, env, **kw):
    return subprocess.run([BIN, *args], env=env, check=True, **kw)


def run_consumer(args, env, **kw):
    return subprocess.run([BENCH_BIN, *args], env=env, check=True, **kw)


def profile(mode, extra, messages, concurrency):
    db = f"inboxctl_profile_{mode.replace('-', '_')}"
    psql("postgres", f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
    env = dict(os.environ,
               DATABASE_URL=f"postgres://postgres@127.0.0.1:5432/{db}",
               AMQP_URL=f"amqp://127.0.0.1:5672/{VHOST}",
               RUST_LOG="error")
    queue = f"profile-{mode}"
    exchange = f"profile-{mode}-events"
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run(["migrate"], env, **quiet)
    if mode == "tutorial":
        # As the bench does (see TUTORIAL_PLANNING in bench/src/sql.rs): planned per execution, as EF Core's
        # unprepared look-up is, not once on the empty table.
        psql("postgres", f"ALTER DATABASE {db} SET plan_cache_mode = force_custom_plan")
    # The consumer_type is the queue's name.
    consume = ["consume", "--queue", queue, "--exchange", exchange,
               "--concurrency", str(concurrency), "--prefetch", "64", *extra]
    # Declare the topology, then load the queue.
    run_consumer([*consume, "--exit-when-idle", "1s"], env, **quiet)
    run(["publish", "parcel-created", "--count", str(messages), "--exchange", exchange], env, **quiet)
    psql(db, "TRUNCATE inbox_messages, carrier_reservations, inboxctl_events")
    xact0 = int(psql(db, f"SELECT xact_commit FROM pg_stat_database WHERE datname = '{db}'"))
    wal0 = psql(db, "SELECT pg_current_wal_lsn()")

    pg0, mq0 = cpu("postgres", True), cpu("beam.smp", False)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    run_consumer([*consume, "--exit-when-idle", "1s"], env, **quiet)
    wall = time.monotonic() - started - 1.0  # the idle second at the end
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    pg1, mq1 = cpu("postgres", True), cpu("beam.smp", False)

    # Stats are sent at transaction end and flushed lazily: give them a moment.
    time.sleep(1.0)
    xact1 = int(psql(db, f"SELECT xact_commit FROM pg_stat_database WHERE datname = '{db}'"))
    wal = float(psql(db, f"SELECT pg_current_wal_lsn() - '{wal0}'::pg_lsn"))
    effects = int(psql(db, "SELECT count(*) FROM carrier_reservations"))
    psql("postgres", f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
    per = 1e6 / max(effects, 1)
    return {
        "mode": mode,
        "messages": effects,
        "seconds": round(wall, 2),
        "msg_per_s": round(effects / wall) if wall > 0 else None,
        "cpu_us_per_msg": {
            "consumer": round(((after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)) * per, 1),
            "postgres": round((pg1 - pg0) * per, 1),
            "rabbitmq": round((mq1 - mq0) * per, 1),
        },
        "commits_per_msg": round((xact1 - xact0) / max(effects, 1), 3),
        "wal_bytes_per_msg": round(wal / max(effects, 1)),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--messages", type=int, default=20000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--modes", default=",".join(MODES))
    a = p.parse_args()
    subprocess.run(["rabbitmqctl", "-q", "add_vhost", VHOST], capture_output=True)
    subprocess.run(["rabbitmqctl", "-q", "set_permissions", "-p", VHOST, "guest", ".*", ".*", ".*"],
                   check=True, capture_output=True)
    results = []
    try:
        for _ in range(a.repeats):
            for mode in a.modes.split(","):
                r = profile(mode, MODES[mode], a.messages, a.concurrency)
                print(json.dumps(r), flush=True)
                results.append(r)
    finally:
        subprocess.run(["rabbitmqctl", "-q", "delete_vhost", VHOST], capture_output=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
