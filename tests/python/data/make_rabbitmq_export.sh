#!/usr/bin/env bash
# Makes tests/python/data/rabbitmq-3.10-definitions.json, the RabbitMQ export that
# test_definitions_rabbitmq.py imports into Warren: starts a throwaway RabbitMQ 3.10 node (Debian's
# rabbitmq-server; its own directory and free ports, see rabbitmq_node.sh), creates the users,
# vhosts, permissions, limits, policy and topology below, checks each user's password on the node,
# exports the definitions (`rabbitmqctl export_definitions`, pretty-printed), stops the node and
# removes its directory.
#
#   users:  alice  password 'alice-pw'  tags administrator
#           bob    password 'bob pw ü'  tags monitoring,management   (a space and a non-ASCII letter)
#           carol  password 'carol-pw'  no tags; given as a SHA-512 hash (rabbit_password_hashing_sha512)
#           dave   password 'dave-pw'   no tags, no permissions
#           guest  (RabbitMQ's own, kept: a real export has it)
#   vhosts: '/' and 'shop' (description, tags; limits max-connections 10, max-queues 20)
#   permissions: alice .* .* .* on '/' and shop; bob ^bob- .* .* on shop; carol .* .* .* on '/'
#   topic permissions: bob on shop's amq.topic, write and read ^bob\.
#   policy ha-all on shop: pattern .*, {"ha-mode":"all"}
#   in shop: durable classic queue orders, quorum queue payments, topic exchange events,
#            binding events -> orders with key order.*
#
# Usage: tests/python/data/make_rabbitmq_export.sh [OUT]   (OUT defaults to the committed file)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-$HERE/rabbitmq-3.10-definitions.json}
NODE_SH=$HERE/rabbitmq_node.sh
BASE=$(mktemp -d "${TMPDIR:-/tmp}/warren-rmq-export.XXXXXX")
NODE_PID=
cleanup() {
  "$NODE_SH" stop "$BASE" || true
  if [ -n "$NODE_PID" ]; then wait "$NODE_PID" || true; fi
  rm -rf "$BASE"
}
trap cleanup EXIT

"$NODE_SH" prepare "$BASE"
"$NODE_SH" run "$BASE" &
NODE_PID=$!
"$NODE_SH" wait "$BASE"
# shellcheck disable=SC1091
. "$BASE/node.env"
API=http://127.0.0.1:$HTTP_PORT/api
ctl() { "$NODE_SH" ctl "$BASE" "$@"; }

# An HTTP call that must succeed: METHOD PATH JSON [USER:PASSWORD].
call() {
  local code
  code=$(curl -sS -o "$BASE/answer" -w '%{http_code}' -u "${4:-guest:guest}" -X "$1" \
    -H 'content-type: application/json' --data-binary "$3" "$API$2")
  case $code in
    2??) ;;
    *) echo "$1 $2 answered $code: $(cat "$BASE/answer")" >&2; exit 1 ;;
  esac
}

# Users through the HTTP API: JSON carries bob's password as UTF-8 bytes, whatever the locale.
call PUT /users/alice '{"password": "alice-pw", "tags": "administrator"}'
call PUT /users/bob '{"password": "bob pw \u00fc", "tags": "monitoring,management"}'
# carol: RabbitMQ's hash format, base64(salt + sha512(salt + password)) with 4 random salt bytes.
CAROL_HASH=$(python3 -c '
import base64, hashlib, os
salt = os.urandom(4)
print(base64.b64encode(salt + hashlib.sha512(salt + b"carol-pw").digest()).decode())')
call PUT /users/carol "{\"password_hash\": \"$CAROL_HASH\", \"hashing_algorithm\": \"rabbit_password_hashing_sha512\", \"tags\": \"\"}"
call PUT /users/dave '{"password": "dave-pw", "tags": ""}'

ctl add_vhost shop --description "The shop's orders and payments" --tags "production,shop"
ctl set_vhost_limits -p shop '{"max-connections": 10, "max-queues": 20}'

ctl set_permissions -p / alice '.*' '.*' '.*'
ctl set_permissions -p shop alice '.*' '.*' '.*'
ctl set_permissions -p shop bob '^bob-' '.*' '.*'
ctl set_permissions -p / carol '.*' '.*' '.*'
ctl set_topic_permissions -p shop bob amq.topic '^bob\.' '^bob\.'
ctl set_policy -p shop ha-all '.*' '{"ha-mode":"all"}'

# The topology, as alice (guest has no permission on shop).
call PUT /queues/shop/orders '{"durable": true, "auto_delete": false, "arguments": {}}' alice:alice-pw
call PUT /queues/shop/payments '{"durable": true, "auto_delete": false, "arguments": {"x-queue-type": "quorum"}}' alice:alice-pw
call PUT /exchanges/shop/events '{"type": "topic", "durable": true, "auto_delete": false, "internal": false, "arguments": {}}' alice:alice-pw
call POST /bindings/shop/e/events/q/orders '{"routing_key": "order.*", "arguments": {}}' alice:alice-pw

# Every password works on RabbitMQ itself (the bytes: bob's ü given to rabbitmqctl as UTF-8).
ctl authenticate_user alice 'alice-pw' > /dev/null
ctl authenticate_user bob "$(printf 'bob pw \303\274')" > /dev/null
ctl authenticate_user carol 'carol-pw' > /dev/null
ctl authenticate_user dave 'dave-pw' > /dev/null

ctl export_definitions "$BASE/export.json" > /dev/null
python3 - "$BASE/export.json" "$OUT" <<'PY'
import json, sys
with open(sys.argv[1], encoding="utf-8") as f:
    defs = json.load(f)
with open(sys.argv[2], "w", encoding="utf-8") as f:
    json.dump(defs, f, indent=2, ensure_ascii=False)
    f.write("\n")
PY
echo "wrote $OUT (RabbitMQ $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["rabbitmq_version"])' "$OUT"))"
