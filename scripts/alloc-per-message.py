#!/usr/bin/env python3
"""Heap allocations per message of `inboxctl consume`, under valgrind's DHAT.

Runs `inboxctl consume carrier --exit-when-idle 1s` twice under DHAT: once on an empty queue (start-up and shut-down
alone), once on N pre-loaded messages; the difference, divided by N, is what one message costs: allocations (blocks)
and bytes allocated. With --batch-size it measures batched mode. Needs valgrind and a release build:

    cargo build --release && scripts/alloc-per-message.py [--messages 2000] [--batch-size 32] [--bin PATH]

It uses a scratch database (inboxctl_alloc) and the vhost inboxctl-alloc, and drops them afterwards. With
KEEP_DHAT=FILE set, the loaded run's DHAT profile is kept in FILE.
"""

import argparse
import json
import os
import shutil
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DB = "inboxctl_alloc"
VHOST = "inboxctl-alloc"


def sh(*args, **kw):
    return subprocess.run(list(args), check=True, **kw)


def psql(sql):
    sh("psql", "-h", "127.0.0.1", "-U", "postgres", "-d", "postgres", "-qAtc", sql,
       stdout=subprocess.DEVNULL)


def totals(path):
    """Total blocks and bytes allocated, from a DHAT output file."""
    with open(path) as f:
        data = json.load(f)
    if os.environ.get("KEEP_DHAT"):
        # The last run's profile, for a look at its allocation sites (dh_view.html, or json.load).
        shutil.copy(path, os.environ["KEEP_DHAT"])
    return sum(p["tbk"] for p in data["pps"]), sum(p["tb"] for p in data["pps"])


def consume(binary, env, extra, workdir):
    out = os.path.join(workdir, "dhat.out")
    if os.path.exists(out):
        os.remove(out)
    sh("valgrind", "--tool=dhat", f"--dhat-out-file={out}", binary, "consume", "carrier",
       "--exit-when-idle", "1s", *extra, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return totals(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=0)
    p.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "inboxctl"))
    a = p.parse_args()

    psql(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")
    psql(f"CREATE DATABASE {DB}")
    subprocess.run(["rabbitmqctl", "-q", "delete_vhost", VHOST], capture_output=True)
    sh("rabbitmqctl", "-q", "add_vhost", VHOST, stdout=subprocess.DEVNULL)
    sh("rabbitmqctl", "-q", "set_permissions", "-p", VHOST, "guest", ".*", ".*", ".*",
       stdout=subprocess.DEVNULL)
    env = dict(os.environ,
               DATABASE_URL=f"postgres://postgres@127.0.0.1:5432/{DB}",
               AMQP_URL=f"amqp://127.0.0.1:5672/{VHOST}",
               RUST_LOG="error")
    extra = ["--batch-size", str(a.batch_size)] if a.batch_size else []
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        sh(a.bin, "migrate", env=env, **quiet)
        with tempfile.TemporaryDirectory() as workdir:
            # The first run declares the topology; the second is the idle baseline.
            consume(a.bin, env, extra, workdir)
            idle = consume(a.bin, env, extra, workdir)
            sh(a.bin, "publish", "parcel-created", "--count", str(a.messages), env=env, **quiet)
            busy = consume(a.bin, env, extra, workdir)
        n = a.messages
        print(json.dumps({
            "binary": a.bin,
            "messages": n,
            "batch_size": a.batch_size or None,
            "allocations_per_msg": round((busy[0] - idle[0]) / n, 1),
            "bytes_per_msg": round((busy[1] - idle[1]) / n),
        }))
    finally:
        psql(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")
        subprocess.run(["rabbitmqctl", "-q", "delete_vhost", VHOST], capture_output=True)


if __name__ == "__main__":
    main()
