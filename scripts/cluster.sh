#!/usr/bin/env bash
# A RabbitMQ cluster of private nodes on loopback, for the cluster tests and for trying inboxctl on one by hand:
# each node with its own name, AMQP port, distribution port and directories under DIR, all joined into one cluster,
# the consistent-hash exchange plugin enabled. It never touches the shared broker on 5672. Needs Debian's
# rabbitmq-server (run as root: the nodes run as the rabbitmq user, as Debian's scripts do).
#
#   scripts/cluster.sh start DIR [NODES]   start NODES nodes (3) and cluster them; prints one AMQP URL per node
#   scripts/cluster.sh urls DIR            the AMQP URLs, one per line
#   scripts/cluster.sh kill DIR N          SIGKILL node N (1-based): no clean shutdown, as a crashed machine
#   scripts/cluster.sh boot DIR N          start node N again (it rejoins the cluster by itself)
#   scripts/cluster.sh leader DIR QUEUE    the number of the node holding QUEUE's quorum leader
#   scripts/cluster.sh stop DIR            stop every node and remove DIR
set -euo pipefail

cmd=${1:?usage: cluster.sh start|urls|kill|boot|leader|stop DIR ...}
dir=${2:?usage: cluster.sh $cmd DIR ...}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

node_name() { # N
  echo "$(cat "$dir/id")-$1@localhost"
}

ctl() { # N args...
  local n=$1
  shift
  rabbitmqctl -q -n "$(node_name "$n")" "$@"
}

boot() { # N
  local n=$1 d="$dir/n$1"
  RABBITMQ_NODENAME="$(node_name "$n")" \
    RABBITMQ_DIST_PORT="$(cat "$d/dist_port")" \
    RABBITMQ_MNESIA_BASE="$d/mnesia" \
    RABBITMQ_LOG_BASE="$d/log" \
    RABBITMQ_ENABLED_PLUGINS_FILE="$d/plugins" \
    RABBITMQ_PID_FILE="$d/pid" \
    RABBITMQ_CONFIG_FILE="$d/rabbitmq.conf" \
    RABBITMQ_CONF_ENV_FILE="$d/env.conf" \
    rabbitmq-server -detached >/dev/null 2>&1
  # A node that was a member waits for the others to rejoin; one of three waits only for a quorum.
  for _ in $(seq 1 120); do
    if ctl "$n" await_startup --timeout 5 >/dev/null 2>&1; then
      return 0
    fi
    sleep 0.5
  done
  echo "node $n did not start: see $d/log" >&2
  return 1
}

urls() {
  local n
  for n in $(seq 1 "$(cat "$dir/nodes")"); do
    echo "amqp://guest:guest@127.0.0.1:$(cat "$dir/n$n/port")/%2f"
  done
}

case $cmd in
start)
  nodes=${3:-3}
  mkdir -p "$dir"
  echo "inboxctl-$(head -c 6 /dev/urandom | od -An -tx1 | tr -d ' \n')" >"$dir/id"
  echo "$nodes" >"$dir/nodes"
  for n in $(seq 1 "$nodes"); do
    d="$dir/n$n"
    mkdir -p "$d/mnesia" "$d/log"
    free_port >"$d/port"
    free_port >"$d/dist_port"
    echo "[rabbitmq_consistent_hash_exchange]." >"$d/plugins"
    cat >"$d/rabbitmq.conf" <<EOF
listeners.tcp.local = 127.0.0.1:$(cat "$d/port")
loopback_users = none
EOF
    echo "ERL_EPMD_ADDRESS=127.0.0.1" >"$d/env.conf"
  done
  chown -R rabbitmq:rabbitmq "$dir"
  for n in $(seq 1 "$nodes"); do
    boot "$n"
  done
  for n in $(seq 2 "$nodes"); do
    ctl "$n" stop_app >/dev/null
    ctl "$n" join_cluster "$(node_name 1)" >/dev/null
    ctl "$n" start_app >/dev/null
  done
  urls
  ;;
urls)
  urls
  ;;
kill)
  n=${3:?node number}
  pid=$(cat "$dir/n$n/pid")
  kill -9 "$pid"
  while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
  ;;
boot)
  boot "${3:?node number}"
  ;;
leader)
  queue=${3:?queue}
  for n in $(seq 1 "$(cat "$dir/nodes")"); do
    if line=$(ctl "$n" list_queues name leader --no-table-headers 2>/dev/null); then
      leader=$(echo "$line" | awk -v q="$queue" '$1 == q { print $2 }')
      for m in $(seq 1 "$(cat "$dir/nodes")"); do
        if [ "$leader" = "$(node_name "$m")" ]; then
          echo "$m"
          exit 0
        fi
      done
    fi
  done
  echo "no leader found for $queue" >&2
  exit 1
  ;;
stop)
  if [ -f "$dir/nodes" ]; then
    for n in $(seq 1 "$(cat "$dir/nodes")"); do
      if [ -f "$dir/n$n/pid" ]; then
        pid=$(cat "$dir/n$n/pid")
        kill -9 "$pid" 2>/dev/null || true
      fi
    done
  fi
  rm -rf "$dir"
  ;;
*)
  echo "unknown command $cmd" >&2
  exit 64
  ;;
esac
