"""The user's acceptance suite (shared/spec/test_protocols.py) against the served default core.

It runs whole, in its own pytest process, except the rows listed in EXPECTED_FAILURES: rows the
0.5B default model cannot pass, each with its reason. Those rows run afterwards on their own; one
that passes there is reported (a pytest warning) so the list shrinks. A row of SAMPLED_ROWS (it
samples at temperature 1 without a seed, so the small model misses now and then) that fails is
run again on its own, up to SAMPLED_ATTEMPTS times in all, and passes if one attempt does.

FLARE_USER_SUITE names the suite file; unset, the test looks beside the repository
(../shared/spec/test_protocols.py) and skips where a clone has none. .ci/run sets it, so in CI a
missing suite is a failure, never a skip.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e

# Suite rows (node ids relative to the suite file) the default model answers wrongly; the
# protocol path of each passes on a core whose model can (docs/conformance.md).
EXPECTED_FAILURES: dict[str, str] = {
    "test_messages_tool_history": "answers a tool result by calling the tool again instead of with text",
    "test_responses_tool_history": "answers a tool result by calling the tool again instead of with text",
    "test_responses_custom_tool_grammar": "calls the custom tool again after its result instead of answering",
    "test_reasoning_and_incomplete_output": "the core has no reasoning syntax (Qwen2.5-Coder does not think)",
    "test_image_input": "the core is text-only",
    **{
        f"test_multiple_tool_calls_fail_when_parallel_calls_are_disabled[{protocol}-{streaming}]": (
            "makes one call where the row needs the model to attempt two"
        )
        for protocol in ("chat/completions", "messages", "responses")
        for streaming in (False, True)
    },
}


# Rows that sample at temperature 1 with no seed, where the default model fails some draws.
SAMPLED_ROWS: dict[str, str] = {
    f"test_required_tool_choice_sdk_contracts[{streaming}]": (
        "three required-mode calls at temperature 1; the model misses the call in ~20% of draws "
        "(13 of 60 unseeded chat and Messages calls on AMD Zen 4), so the row fails about 1 run in 2"
    )
    for streaming in (False, True)
}
SAMPLED_ATTEMPTS = 10  # a row that passes 1 run in 2 fails all ten ~0.1% of the time


def suite_file() -> Path | None:
    """The suite named by FLARE_USER_SUITE (it must exist), else the one beside the repository."""
    named = os.environ.get("FLARE_USER_SUITE")
    if named:
        path = Path(named).resolve()
        assert path.is_file(), f"FLARE_USER_SUITE={named} is not a file"
        return path
    beside = REPO.parent / "shared" / "spec" / "test_protocols.py"
    return beside if beside.is_file() else None


def run_suite(suite: Path, url: str, folder: Path, name: str, selection: list[str]) -> dict[str, str]:
    """One pytest run of the suite against `url` (`selection`: rows' node ids, or pytest arguments
    for the whole file), in its own process with its own empty configuration; returns each row's
    outcome."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pytest.ini").write_text("[pytest]\n")
    report = folder / f"{name}.xml"
    env = {**os.environ, "FLARE_API_TEST_URL": url, "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("FLARE_API_TEST_KEY", None)  # the served core has no key
    # Node ids select rows themselves; other arguments (--deselect) apply to the whole file.
    targets = selection if selection and selection[0].startswith(suite.name + "::") else [suite.name, *selection]
    command = [sys.executable, "-m", "pytest", *targets, "-q", "-p", "no:cacheprovider"]
    command += ["-c", str(folder / "pytest.ini"), "--rootdir", str(suite.parent), "-o", "timeout=300"]
    command += [f"--junitxml={report}"]
    run = subprocess.run(command, cwd=suite.parent, env=env, capture_output=True, text=True, timeout=1800)
    assert report.is_file(), run.stdout[-4000:] + run.stderr[-4000:]
    outcomes = {}
    for case in ElementTree.parse(report).iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
        outcomes[case.get("name")] = outcome
    print(run.stdout[-6000:])
    return outcomes


def test_user_suite_passes_but_the_listed_rows(default_server, tmp_path):
    suite = suite_file()
    if suite is None:
        pytest.skip("no user suite beside the repository (../shared/spec/test_protocols.py); set FLARE_USER_SUITE")
    deselect = [arg for row in EXPECTED_FAILURES for arg in ("--deselect", f"{suite.name}::{row}")]
    outcomes = run_suite(suite, default_server.url, tmp_path, "suite", deselect)
    assert len(outcomes) >= 60, f"only {len(outcomes)} rows ran: the suite did not load"
    failed = sorted(name for name, outcome in outcomes.items() if outcome == "failed")
    for attempt in range(1, SAMPLED_ATTEMPTS):
        again = [name for name in failed if name in SAMPLED_ROWS]
        if not again:
            break
        rerun = run_suite(
            suite, default_server.url, tmp_path, f"sampled-{attempt}", [f"{suite.name}::{n}" for n in again]
        )
        failed = sorted(name for name in failed if rerun.get(name) != "passed")
    assert not failed, f"user suite rows failed on the default core: {failed}"
    assert set(outcomes).isdisjoint(EXPECTED_FAILURES), "a listed row was not deselected"

    listed = run_suite(
        suite, default_server.url, tmp_path, "listed", [f"{suite.name}::{row}" for row in EXPECTED_FAILURES]
    )
    assert set(listed) == set(EXPECTED_FAILURES), (
        f"listed rows missing from the suite: {set(EXPECTED_FAILURES) - set(listed)}"
    )
    now_passing = sorted(name for name, outcome in listed.items() if outcome == "passed")
    if now_passing:
        warnings.warn(f"listed user-suite rows now pass; drop them from EXPECTED_FAILURES: {now_passing}", stacklevel=1)
