#!/usr/bin/env bash
# `make image-smoke`: run the image as an operator would and check it, then remove what it started.
#   - serves on a port other than 8000 (LONGDOC_PORT), with a named volume for sessions;
#   - /readyz, then a book ingested and a question about its middle answered;
#   - the server runs as a non-root user, and `podman healthcheck run` says healthy on that port;
#   - a second container on the same volume finds the session and answers the same.
set -euo pipefail
cd "$(dirname "$0")/../.."
image=${IMAGE:-longdoc:latest}
port=${PORT:-18431}
name=longdoc-smoke-$$
volume=longdoc-smoke-$$
url=http://127.0.0.1:$port
book=tests/fixtures/alice29.txt
question="What were the names of the three little sisters in the Dormouse's story?"

if [ -z "${CONTAINERS_CONF:-}" ]; then  # podman's default ulimits cannot be set inside this sandbox
  conf=$(mktemp)
  printf '[containers]\ndefault_ulimits = []\n' > "$conf"
  export CONTAINERS_CONF=$conf
fi
run() { podman run -d --name "$1" --runtime runc --network host -e LONGDOC_PORT="$port" -v "$volume:/var/lib/longdoc" "$image" >/dev/null; }
cleanup() {
  podman rm -f "$name" "$name-2" >/dev/null 2>&1 || true
  podman volume rm -f "$volume" >/dev/null 2>&1 || true
  [ -z "${conf:-}" ] || rm -f "$conf"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; podman logs --tail 30 "$1" >&2 || true; exit 1; }

wait_ready() {  # $1: container
  local start=$SECONDS
  until [ "$(curl -s -o /dev/null -w '%{http_code}' "$url/readyz")" = 200 ]; do
    [ "$(podman inspect --format '{{.State.Running}}' "$1")" = true ] || fail "$1" "the container exited"
    [ $((SECONDS - start)) -lt 300 ] || fail "$1" "not ready after 300 s"
    sleep 1
  done
  echo "ok   ready on port $port after $((SECONDS - start)) s"
}

ask() {  # $1: session -> the answer
  curl -sf "$url/v1/sessions/$1/ask" -H 'content-type: application/json' \
    -d "$(python3 -c 'import json, sys; print(json.dumps({"question": sys.argv[1], "max_tokens": 48}))' "$question")" |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["answer"])'
}

echo "image $image: $(podman image inspect --format '{{.Size}}' "$image") bytes"
run "$name"
wait_ready "$name"

session=$(curl -sf "$url/v1/sessions" -H 'content-type: application/json' -d '{"memory": "text"}' |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["id"])')
tokens=$(curl -sf "$url/v1/sessions/$session/documents" -H 'content-type: text/plain' --data-binary "@$book" |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["tokens"])')
answer=$(ask "$session")
echo "ok   ingested $tokens tokens; asked: $question"
echo "     answer: $answer"
hits=$(grep -o -E 'Elsie|Lacie|Tillie' <<<"$answer" | sort -u | wc -l)
[ "$hits" -ge 2 ] || fail "$name" "the answer names $hits of Elsie, Lacie, Tillie"
echo "ok   the answer names $hits of the three sisters"

uid=$(podman exec "$name" id -u)
server_user=$(podman top "$name" user | awk 'NR == 2 {print $1}')
[ "$uid" != 0 ] && [ "$server_user" != root ] || fail "$name" "runs as root (exec uid $uid, server $server_user)"
echo "ok   non-root: exec uid $uid, server process user $server_user"

podman healthcheck run "$name" >/dev/null || fail "$name" "podman healthcheck run failed on port $port"
echo "ok   podman healthcheck run: healthy on port $port"

podman rm -f "$name" >/dev/null
run "$name-2"
wait_ready "$name-2"
again=$(ask "$session")
[ "$again" = "$answer" ] || fail "$name-2" "after a new container the answer was: $again"
echo "ok   a new container on the same volume has session $session and answers the same"
echo "image smoke test passed"
