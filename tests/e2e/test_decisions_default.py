"""End to end on the real default core (exported without --prompt-logprobs): the decision
endpoints answer obvious questions correctly, and prompt scoring is refused with the re-export
message while explicit-id generation logprobs still work."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.e2e

STATE = "Invoice 1042 for $250 was paid in full by card on March 3. The customer is happy."


@pytest.fixture(scope="module")
def http(default_server):
    with httpx.Client(base_url=default_server.url, timeout=300) as client:
        yield client


def test_decisions_answer_obvious_questions(http):
    body = {
        "model": "local",
        "input": STATE,
        "questions": [
            {"type": "predicate", "name": "paid", "instructions": "Was the invoice paid?"},
            {"type": "predicate", "name": "unpaid", "instructions": "Is the invoice still unpaid?"},
            {
                "type": "choice",
                "name": "method",
                "instructions": "How was the invoice paid?",
                "choices": [{"value": "cash"}, {"value": "card"}, {"value": "bank transfer"}],
            },
        ],
    }
    response = http.post("/v1/decisions", json=body, headers={"X-Request-Id": "decide-1"})
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == "decide-1"  # it reached model submission
    paid, unpaid, method = response.json()["answers"]
    # The 0.5B is weakly calibrated (P(yes) ~0.6 either way, docs/conformance.md), but it ranks
    # the true statement above its negation.
    assert paid["probability"] > 0.5 and paid["probability"] > unpaid["probability"]
    assert [c["value"] for c in method["probabilities"]] == ["cash", "card", "bank transfer"]
    assert sum(c["probability"] for c in method["probabilities"]) == pytest.approx(1)


def test_systemone_answers_obvious_questions(http):
    body = {
        "model": "local",
        "state": {"ticket": STATE},
        "questions": {
            "paid": {"type": "noul", "instructions": "Was the invoice paid?"},
            "mood": {
                "type": "choice",
                "instructions": "How does the customer feel?",
                "criteria": {"happy": None, "angry": None},
            },
        },
    }
    response = http.post("/v1/systemone", json=body)
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"].startswith("sysone-")
    answers = response.json()["answers"]
    assert answers["paid"]["noul"] > 0.5
    assert answers["mood"]["choice"] == "happy"


def test_prompt_scoring_needs_a_re_export_but_explicit_ids_work(http):
    response = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 0, "echo": True, "logprobs": 1})
    assert response.status_code == 400 and "--prompt-logprobs" in response.json()["error"]["message"]
    response = http.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Reply with exactly OK."}],
            "max_tokens": 1,
            "temperature": 0,
            "top_k": 1,
            "logprobs": True,
            "logprob_token_ids": [3925, 11],
        },
    )  # "OK", ","
    assert response.status_code == 200, response.text
    entry = response.json()["choices"][0]["logprobs"]["content"][0]
    assert [t["token"] for t in entry["top_logprobs"]][:2] == ["OK", ","]
    assert entry["token"] == "OK" and entry["top_logprobs"][0]["logprob"] > -0.5
