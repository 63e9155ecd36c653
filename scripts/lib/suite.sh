# Shared by scripts/acceptance.sh and scripts/conformance.sh: locate the user's suite and the
# Python to run it with, check the core, and start / stop one `helios serve` on a free port.
# Source it after setting REPO, CORE and NAME (the calling script's name, for messages).
# LAUNCH (an array) is how Python starts helios; the default is the plain CLI.

SPEC="${FLARE_SPEC:-$REPO/../shared/spec/test_protocols.py}"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
[ -n "${LAUNCH+x}" ] || LAUNCH=(-m helios.cli)

if [ ! -f "$CORE/core.json" ]; then
  echo "$NAME: $CORE is not a core (no core.json); export one with" >&2
  echo "  ignition export --recipe qwen25_coder --out cores/default" >&2
  exit 2
fi
if [ ! -f "$SPEC" ]; then
  echo "$NAME: the suite $SPEC does not exist (set FLARE_SPEC)" >&2
  exit 2
fi

SERVER_PID=""
cleanup() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill "$SERVER_PID" 2>/dev/null
    wait "$SERVER_PID" 2>/dev/null
  fi
  SERVER_PID=""
}

free_port() {
  "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# start_server LOG [serve args...]: launch helios on a free port (URL) and wait for /health.
start_server() {
  local log="$1"; shift
  PORT="$(free_port)"
  URL="http://127.0.0.1:$PORT"
  (cd "$REPO" && exec "$PYTHON" "${LAUNCH[@]}" serve "$CORE" --port "$PORT" "$@") >"$log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 1200); do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      echo "$NAME: helios exited during startup:" >&2; tail -n 40 "$log" >&2; return 1
    fi
    if "$PYTHON" -c "import httpx, sys; sys.exit(httpx.get('$URL/health', timeout=2).status_code != 200)" 2>/dev/null; then
      return 0
    fi
    sleep 0.5
  done
  echo "$NAME: helios did not become healthy:" >&2; tail -n 40 "$log" >&2; return 1
}
