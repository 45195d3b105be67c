#!/usr/bin/env bash
# A throwaway single RabbitMQ node (Debian's rabbitmq-server, 3.10) with the management plugin,
# everything under its own directory and on its own ports, so it never meets a node on 5672/15672.
# Used by make_rabbitmq_export.sh and by test_definitions_rabbitmq.py:
#
#   rabbitmq_node.sh prepare BASE     picks the ports and node name, writes the config (BASE/node.env)
#   rabbitmq_node.sh run BASE         runs the node in the foreground (the caller backgrounds it and
#                                     reaps it: a process of its own, not one left to init)
#   rabbitmq_node.sh wait BASE        until it serves AMQP and HTTP; prints "amqp=P http=P node=NAME"
#   rabbitmq_node.sh ctl BASE ARGS... rabbitmqctl against it
#   rabbitmq_node.sh stop BASE        stops it (rabbitmqctl stop, then kill -9 of its OS pid if still there)
#
# Ports: AMQP_PORT, HTTP_PORT and DIST_PORT from the environment, else free ones picked here.
# The node runs as the current user (root too) from /usr/lib/rabbitmq/bin directly (not Debian's
# su-wrapper), with HOME=BASE/home so the node and its CLI share one Erlang cookie. epmd (port 4369)
# is shared with any other Erlang node on the machine: the node starts it if none runs, and leaves it.
set -euo pipefail
RBIN=${RABBITMQ_BIN:-/usr/lib/rabbitmq/bin}
cmd=${1:?usage: rabbitmq_node.sh prepare|run|wait|ctl|stop BASE}
BASE=${2:?usage: rabbitmq_node.sh prepare|run|wait|ctl|stop BASE}
mkdir -p "$BASE"
BASE=$(cd "$BASE" && pwd)
export HOME=$BASE/home

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

node_env() {
  echo "RABBITMQ_NODENAME=$NODE RABBITMQ_NODE_PORT=$AMQP_PORT RABBITMQ_DIST_PORT=$DIST_PORT \
RABBITMQ_MNESIA_BASE=$BASE/mnesia RABBITMQ_LOG_BASE=$BASE/log RABBITMQ_PID_FILE=$BASE/pid \
RABBITMQ_ENABLED_PLUGINS_FILE=$BASE/enabled_plugins RABBITMQ_CONFIG_FILE=$BASE/rabbitmq.conf \
RABBITMQ_ADVANCED_CONFIG_FILE=$BASE/advanced.config RABBITMQ_CONF_ENV_FILE=$BASE/rabbitmq-env.conf"
}

load() {
  [ -f "$BASE/node.env" ] || { echo "no node started under $BASE" >&2; exit 1; }
  # shellcheck disable=SC1091
  . "$BASE/node.env"
}

ctl() {
  env $(node_env) "$RBIN/rabbitmqctl" -q -n "$NODE" "$@"
}

case $cmd in
prepare)
  [ -x "$RBIN/rabbitmq-server" ] || { echo "$RBIN/rabbitmq-server not found (apt-get install rabbitmq-server)" >&2; exit 2; }
  mkdir -p "$HOME" "$BASE/mnesia" "$BASE/log"
  [ -f "$HOME/.erlang.cookie" ] || { head -c 32 /dev/urandom | md5sum | cut -c1-20 > "$HOME/.erlang.cookie"; chmod 400 "$HOME/.erlang.cookie"; }
  AMQP_PORT=${AMQP_PORT:-$(free_port)}
  HTTP_PORT=${HTTP_PORT:-$(free_port)}
  DIST_PORT=${DIST_PORT:-$(free_port)}
  # A name of its own: epmd refuses a second node of the same name on this host.
  NODE=warren-defs-$(head -c 6 /dev/urandom | od -An -tx1 | tr -d ' \n')@localhost
  printf 'NODE=%s\nAMQP_PORT=%s\nHTTP_PORT=%s\nDIST_PORT=%s\n' "$NODE" "$AMQP_PORT" "$HTTP_PORT" "$DIST_PORT" > "$BASE/node.env"
  echo "[rabbitmq_management]." > "$BASE/enabled_plugins"
  : > "$BASE/rabbitmq-env.conf"
  cat > "$BASE/rabbitmq.conf" <<CONF
listeners.tcp.1 = 127.0.0.1:$AMQP_PORT
management.tcp.ip = 127.0.0.1
management.tcp.port = $HTTP_PORT
log.console = false
log.file.level = warning
CONF
  rm -f "$BASE/pid"
  ;;
run)
  load
  # rabbitmq-server stays as a small sh that runs the VM and stops it on SIGTERM.
  exec env $(node_env) "$RBIN/rabbitmq-server" < /dev/null > "$BASE/log/stdout.log" 2>&1
  ;;
wait)
  load
  if ! ctl wait "$BASE/pid" --timeout "${WAIT_SECONDS:-60}" > /dev/null; then
    echo "RabbitMQ did not start; its output:" >&2; tail -n 40 "$BASE/log/stdout.log" >&2
    exit 1
  fi
  # The management listener comes up with the plugin; wait until it answers.
  for _ in $(seq 1 100); do
    curl -fsS -o /dev/null -u guest:guest "http://127.0.0.1:$HTTP_PORT/api/overview" && break
    sleep 0.1
  done
  echo "amqp=$AMQP_PORT http=$HTTP_PORT node=$NODE"
  ;;
ctl)
  load
  shift 2
  ctl "$@"
  ;;
stop)
  [ -f "$BASE/node.env" ] || exit 0
  load
  pid=$(cat "$BASE/pid" 2>/dev/null || true)
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    ctl stop "$BASE/pid" > /dev/null 2>&1 || true
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null || true
  fi
  ;;
*)
  echo "usage: rabbitmq_node.sh prepare|run|wait|ctl|stop BASE" >&2; exit 2
  ;;
esac
