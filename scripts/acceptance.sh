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
NAME=acceptance
source "$REPO/scripts/lib/suite.sh"

WORK="$(mktemp -d)"
trap 'cleanup; rm -rf "$WORK"' EXIT
trap 'exit 130' INT TERM

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
