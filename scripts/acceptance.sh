#!/usr/bin/env bash
# Run the user's protocol acceptance suite against a live `helios serve` on a core, twice:
# without authentication, then with a serving key (FLARE_API_TEST_KEY), stopping each server.
#
#   scripts/acceptance.sh [CORE] [pytest args...]
#
# CORE defaults to cores/default. The suite is ../shared/spec/test_protocols.py relative to the
# repository (override with FLARE_SPEC). Extra arguments go to pytest, e.g. -k "messages or ollama".
# Exit status: nonzero if either run failed.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CORE="${1:-$REPO/cores/default}"
shift $(( $# > 0 ? 1 : 0 ))
SPEC="${FLARE_SPEC:-$REPO/../shared/spec/test_protocols.py}"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3

if [ ! -f "$CORE/core.json" ]; then
  echo "acceptance: $CORE is not a core (no core.json); export one with" >&2
  echo "  ignition export --recipe qwen25_coder --out cores/default" >&2
  exit 2
fi
if [ ! -f "$SPEC" ]; then
  echo "acceptance: the suite $SPEC does not exist (set FLARE_SPEC)" >&2
  exit 2
fi

WORK="$(mktemp -d)"
SERVER_PID=""
cleanup() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill "$SERVER_PID" 2>/dev/null
    wait "$SERVER_PID" 2>/dev/null
  fi
  SERVER_PID=""
}
trap 'cleanup; rm -rf "$WORK"' EXIT
trap 'exit 130' INT TERM

free_port() {
  "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# start_server LOG [serve args...]: launch helios and wait until /health answers.
start_server() {
  local log="$1"; shift
  PORT="$(free_port)"
  URL="http://127.0.0.1:$PORT"
  (cd "$REPO" && exec "$PYTHON" -m helios.cli serve "$CORE" --port "$PORT" "$@") >"$log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 600); do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      echo "acceptance: helios exited during startup:" >&2; tail -n 40 "$log" >&2; return 1
    fi
    if "$PYTHON" -c "import httpx, sys; sys.exit(httpx.get('$URL/health', timeout=2).status_code != 200)" 2>/dev/null; then
      return 0
    fi
    sleep 0.5
  done
  echo "acceptance: helios did not become healthy:" >&2; tail -n 40 "$log" >&2; return 1
}

# run_suite NAME KEY [pytest args...]: one server, one pytest run.
run_suite() {
  local name="$1" key="$2"; shift 2
  local args=()
  if [ -n "$key" ]; then
    printf '%s\n' "$key" >"$WORK/key"
    args=(--api-key-file "$WORK/key")
  fi
  echo "== acceptance ($name): $CORE"
  start_server "$WORK/helios-$name.log" "${args[@]}" || return 1
  # The suite lives outside the repository: no cache dir there, rootdir stays the repository.
  # FLARE_API_TEST_KEY is absent (not empty) for the unauthenticated run.
  local env=(env -u FLARE_API_TEST_KEY FLARE_API_TEST_URL="$URL")
  [ -n "$key" ] && env+=(FLARE_API_TEST_KEY="$key")
  (cd "$REPO" && "${env[@]}" "$PYTHON" -m pytest "$SPEC" -q -rfE -p no:cacheprovider --rootdir "$REPO" "$@")
  local status=$?
  cleanup
  return $status
}

status=0
run_suite open "" "$@" || status=1
run_suite keyed "acceptance-$RANDOM-$RANDOM" "$@" || status=1
exit $status
