#!/usr/bin/env bash
# Conformance run of the user's protocol suite against one core, keeping the raw model output.
#
#   scripts/conformance.sh CORE [OUT_DIR] [pytest args...]
#
# Starts `helios serve CORE` on a free port with the `helios.output` logger at DEBUG, so the
# server log holds every rendered prompt and every answer's raw generated text (the material
# docs/conformance.md quotes), then runs the suite twice: the tools subset (tools, structured
# output, reasoning, custom tools, required and parallel calls) and the whole file. Results go
# to OUT_DIR (default: a new temporary folder, printed): helios.log, subset.txt, full.txt.
# Extra arguments go to both pytest runs. The suite is ../shared/spec/test_protocols.py relative
# to the repository (override with FLARE_SPEC). FLARE_CONFORMANCE_RUNS="subset" (or "full") runs
# only that one. Exit status: nonzero if any run failed.
#
#   scripts/conformance.sh cores/quality /tmp/conformance-1.5b
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ $# -lt 1 ]; then
  sed -n '2,14p' "${BASH_SOURCE[0]}" >&2
  exit 2
fi
CORE="$(cd "$1" 2>/dev/null && pwd || echo "$1")"
shift
OUT=""
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then OUT="$1"; shift; fi
OUT="${OUT:-$(mktemp -d -t flare-conformance.XXXXXX)}"
mkdir -p "$OUT"
SUBSET="tool or structured or reasoning or custom or required or parallel"
RUNS="${FLARE_CONFORMANCE_RUNS:-subset full}"
NAME=conformance
# helios' own basicConfig is a no-op once this one ran; only helios.output is made verbose.
LAUNCH=(-c '
import logging
logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
logging.getLogger("helios.output").setLevel(logging.DEBUG)
from helios.cli import app
app()
')
source "$REPO/scripts/lib/suite.sh"
trap cleanup EXIT
trap 'exit 130' INT TERM

start_server "$OUT/helios.log" || exit 1
echo "== conformance: $CORE at $URL (results in $OUT)"
status=0
run() {
  local name="$1"; shift
  echo "== $name"
  (cd "$REPO" && env -u FLARE_API_TEST_KEY FLARE_API_TEST_URL="$URL" \
    "$PYTHON" -m pytest "$SPEC" -q -rfE -p no:cacheprovider --rootdir "$REPO" "$@") 2>&1 | tee "$OUT/$name.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}
for name in $RUNS; do
  case "$name" in
    subset) run subset -k "$SUBSET" "$@" ;;
    full) run full "$@" ;;
    *) echo "conformance: unknown run $name (subset, full)" >&2; status=1 ;;
  esac
done
echo "== conformance: summaries"
for name in $RUNS; do
  [ -f "$OUT/$name.txt" ] || continue
  printf '%-7s %s\n' "$name" "$(tail -n 1 "$OUT/$name.txt")"
done
echo "raw prompts and outputs: grep -n 'helios.output' $OUT/helios.log"
exit $status
