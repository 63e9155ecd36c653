"""`helios cluster serve` end to end: two replicas of the real default core on Ray Serve behind
one endpoint, driven by the real openai and anthropic SDKs.

One cluster for the module (Ray and two engines take a while to start); the tests run in file
order because the last ones kill and drain replicas.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helios.dashboard import Snapshot
from helios.launcher import ClusterProcess
from tests.conftest import REPO
from tests.unit.live import wait_for

pytest.importorskip("ray.serve", reason="the `cluster` extra (ray[serve]) is not installed")

KEY = "cluster-serving-key"
# A long shared preamble (about 1,000 tokens) so prefix blocks and reuse are clearly visible.
SYSTEM = "You are a careful assistant for the Flare project. " + " ".join(
    f"Rule {n}: keep answer number {n} short and exact." for n in range(90)
)


@pytest.fixture(scope="module")
def cluster(default_core, tmp_path_factory) -> Iterator[ClusterProcess]:
    folder = tmp_path_factory.mktemp("cluster")
    (folder / "key").write_text(KEY + "\n")
    # The replicas share one host-store directory; "always" restores a found chain without
    # weighing it against the prefill (deterministic for the test).
    (folder / "helios.toml").write_text('[server]\ndrain_timeout_s = 60\nhost_store_restore = "always"\n')
    running = ClusterProcess(
        default_core,
        "--threads",
        "1",
        "--api-key-file",
        str(folder / "key"),
        "--config",
        str(folder / "helios.toml"),
        "--host-store",
        str(folder / "store"),
    )
    running.store = folder / "store"
    yield running
    running.stop()


def oai(cluster: ClusterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def chat(cluster: ClusterProcess, question: str, **extra) -> openai.types.chat.ChatCompletion:
    return oai(cluster).chat.completions.create(
        model="local",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=8,
        temperature=0,
        extra_body={"top_k": 1},
        **extra,
    )  # greedy: temperature 0 is clamped


def routed(cluster: ClusterProcess) -> dict[str, int]:
    return {r["replica"]: r["routed"] for r in cluster.metrics()["replicas"]}


def test_sdks_stream_and_errors_keep_their_shapes(cluster):
    client = oai(cluster)
    reply = client.chat.completions.create(
        model="local", messages=[{"role": "user", "content": "Say OK."}], max_tokens=4, temperature=0
    )
    assert reply.choices[0].message.content and reply.usage.prompt_tokens > 0
    chunks = list(
        client.chat.completions.create(
            model="local",
            messages=[{"role": "user", "content": "Count: 1, 2,"}],
            max_tokens=6,
            temperature=0,
            stream=True,
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) and any(
        c.choices and c.choices[0].finish_reason for c in chunks
    )
    messages = anthropic.Anthropic(base_url=cluster.url, api_key=KEY, max_retries=0)
    with messages.messages.stream(
        model="local", max_tokens=6, messages=[{"role": "user", "content": "Say hi."}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "".join(b.text for b in final.content if b.type == "text") and final.stop_reason
    # The frontend's own rules, unchanged behind the cluster: auth, validation, 404, count_tokens.
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=cluster.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=cluster.url, api_key="wrong", max_retries=0).messages.create(
            model="local", max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(
            model="local", messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=500
        )
    too_long = client.completions.create  # a prompt past the context is refused before dispatch (400)
    with pytest.raises(openai.BadRequestError, match="context"):
        too_long(model="local", prompt="word " * 40000, max_tokens=4)
    missing = httpx.get(cluster.url + "/v1/nothing", headers={"Authorization": f"Bearer {KEY}"})
    assert missing.status_code == 404 and missing.json()["error"]["type"]
    counted = messages.messages.count_tokens(model="local", messages=[{"role": "user", "content": "Say hi."}])
    assert counted.input_tokens > 0


def test_requests_sharing_a_prefix_land_on_one_replica(cluster):
    before = routed(cluster)
    first = chat(cluster, "What is rule 3?")
    replies = [chat(cluster, f"What is rule {n}?") for n in (5, 7)]
    after = routed(cluster)
    delta = {r: after.get(r, 0) - before.get(r, 0) for r in after}
    assert sorted(delta.values()) == [0, 3], delta  # all three on one replica
    assert first.usage.prompt_tokens > 900
    for reply in replies:  # and that replica reused the shared preamble
        assert reply.usage.prompt_tokens_details.cached_tokens >= 896
    decisions = cluster.metrics()["routing"]
    assert decisions["prefix"] >= 2


def test_a_session_hint_keeps_a_conversation_together(cluster):
    before = routed(cluster)
    for n in range(3):  # short prompts (no whole block): only the session hint can place them
        oai(cluster).chat.completions.create(
            model="local",
            messages=[{"role": "user", "content": f"Hi {n}"}],
            max_tokens=2,
            extra_body={"prompt_cache_key": "conversation-7"},
        )
    after = routed(cluster)
    assert sorted(after[r] - before.get(r, 0) for r in after) == [0, 3]


def test_prometheus_text_through_the_endpoint(cluster):
    # The earlier tests' requests; replica figures lag (routing stats travel through Ray's controller).
    wait_for(lambda: cluster.metrics()["completed"] >= 5, timeout=10)
    text = httpx.get(cluster.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    replicas = {s.labels["replica"] for s in families["flare_replica_routed"].samples}
    assert len(replicas) == 2
    assert families["flare_cluster_replicas"].samples[0].value == 2
    assert families["flare_requests_completed"].samples[0].value >= 5  # the aggregate over replicas
    assert {s.labels["decision"] for s in families["flare_cluster_routing_decisions"].samples} >= {"prefix", "session"}
    rows = Snapshot.from_json(cluster.metrics()).replicas  # what `helios top` lists
    assert len(rows) == 2 and all(r.healthy for r in rows) and sum(r.routed for r in rows) >= 6


def kill(replica: dict) -> None:
    os.kill(int(replica["label"].rsplit(":", 1)[1]), signal.SIGKILL)


def wait_for_replicas(cluster: ClusterProcess, killed: dict, count: int = 2) -> None:
    """Until `count` healthy replicas serve and the killed one is not among them: its last
    routing stats still say healthy until Ray notices it died."""
    deadline = time.monotonic() + 180  # Ray restarts a killed replica
    labels = [r["label"] for r in cluster.replicas()]
    while (len(labels) < count or killed["label"] in labels) and time.monotonic() < deadline:
        time.sleep(1)
        labels = [r["label"] for r in cluster.replicas()]
    assert len(labels) == count and killed["label"] not in labels, cluster.output()


def test_a_prefix_outlives_its_replica_through_the_shared_disk_tier(cluster):
    question = "Rules again, for the record: " + " ".join(f"item {n} is {n * 7 % 13}." for n in range(80))
    before = routed(cluster)
    first = chat(cluster, question)
    holder = next(r for r in cluster.metrics()["replicas"] if r["routed"] > before.get(r["replica"], 0))
    deadline = time.monotonic() + 30  # the disk writer runs beside the engine
    while not list(cluster.store.rglob("*.rec")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert list(cluster.store.rglob("*.rec"))
    kill(holder)  # its pool and DRAM tier are gone; only the shared directory holds the prefix
    time.sleep(1)
    again = chat(cluster, question)  # whichever replica serves it has never computed it
    assert again.usage.prompt_tokens == first.usage.prompt_tokens
    # Past the shared preamble another replica may hold: the question part exists only on disk.
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 64
    assert again.choices[0].message.content == first.choices[0].message.content  # greedy
    wait_for(lambda: cluster.metrics()["host_hits"] >= 1, timeout=10)  # replica figures lag
    wait_for_replicas(cluster, holder)


def stream_lines(cluster: ClusterProcess, prompt: str, max_tokens: int) -> Iterator[str]:
    body = {
        "model": "local",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream(
        "POST", cluster.url + "/v1/completions", json=body, timeout=120, headers={"Authorization": f"Bearer {KEY}"}
    ) as response:
        assert response.status_code == 200
        yield from (line for line in response.iter_lines() if line)


def serving_replica(cluster: ClusterProcess) -> dict:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        busy = [r for r in cluster.metrics()["replicas"] if r["inflight"] > 0]  # the frontend's own count
        if len(busy) == 1:
            return busy[0]
        time.sleep(0.2)
    raise AssertionError("no single replica reported the request")


def test_a_killed_replica_fails_its_request_cleanly_and_the_endpoint_keeps_serving(cluster):
    lines = stream_lines(cluster, "Once upon a time", 2000)
    received = [next(lines), next(lines)]
    victim = serving_replica(cluster)
    kill(victim)
    received += list(lines)
    assert received[-1] != "data: [DONE]"
    error = received[-1]
    assert error.startswith("data: ") and '"error"' in error and "retry" in error  # OpenAI's stream error shape
    reply = chat(cluster, "What is rule 9?")  # the other replica serves at once
    assert reply.choices[0].finish_reason in ("stop", "length")
    wait_for_replicas(cluster, victim)
    assert cluster.metrics()["replica_failures"] >= 1


def test_scaling_down_drains_in_flight_requests(cluster):
    lines = stream_lines(cluster, "def fibonacci(n):", 48)
    first = next(lines)
    scale = subprocess.run(
        [sys.executable, "-m", "helios.cli", "cluster", "scale", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert scale.returncode == 0, scale.stdout + scale.stderr
    rest = list(lines)  # finishes normally, whichever replica Ray stops
    assert first.startswith("data: ") and rest[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in "".join(rest).replace(" ", "")
    deadline = time.monotonic() + 120
    while len(cluster.metrics()["replicas"]) != 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert len(cluster.metrics()["replicas"]) == 1
    assert chat(cluster, "What is rule 11?").choices[0].finish_reason in ("stop", "length")


def test_sigterm_drains_and_exits(cluster):
    assert cluster.stop() == 0, cluster.output()
