"""Prefix affinity (helios.cluster.affinity): route keys from real rendered tokens, and the
table's ranking: longest prefix run, session tie-break, saturation fallback, forgetting."""

from __future__ import annotations

from helios.cluster.affinity import BLOCK_TOKENS, AffinityTable, RouteKey, route_key
from helios.engine.api import GenerationRequest, ImageInput, SamplingParams


def request(ids: list[int], session: str | None = None, images: list[ImageInput] | None = None) -> GenerationRequest:
    return GenerationRequest(
        request_id="r", prompt_token_ids=ids, sampling=SamplingParams(), images=images or [], session_hint=session
    )


def image(offset: int, digest: bytes) -> ImageInput:
    return ImageInput(offset=offset, tokens=4, grid=(2, 2), size=(28, 28), pixels=None, digest=digest)


def test_route_key_chains_whole_blocks():
    first = list(range(BLOCK_TOKENS * 3 + 5))
    key = route_key(request(first))
    assert len(key.blocks) == 3  # the partial tail block never keys
    longer = route_key(request(first + [7] * BLOCK_TOKENS))
    assert longer.blocks[:3] == key.blocks and len(longer.blocks) == 4
    edited = list(first)
    edited[BLOCK_TOKENS + 1] += 1  # a change in block 1 changes every later block (a chain)
    other = route_key(request(edited))
    assert other.blocks[0] == key.blocks[0] and other.blocks[1] != key.blocks[1] and other.blocks[2] != key.blocks[2]
    assert route_key(request(list(range(BLOCK_TOKENS - 1)), session="s")).blocks == ()


def test_images_are_part_of_their_block():
    ids = [5] * (BLOCK_TOKENS * 2)
    a = route_key(request(ids, images=[image(BLOCK_TOKENS + 3, b"a" * 16)]))
    b = route_key(request(ids, images=[image(BLOCK_TOKENS + 3, b"b" * 16)]))
    assert a.blocks[0] == b.blocks[0] and a.blocks[1] != b.blocks[1]


def test_longest_prefix_wins_and_session_breaks_ties():
    table = AffinityTable()
    shared = route_key(request(list(range(BLOCK_TOKENS * 2))))
    conversation = route_key(request(list(range(BLOCK_TOKENS * 4))))
    table.record(shared, "A")
    table.record(shared, "B")
    table.record(conversation, "B")
    loads = {"A": 0, "B": 0}
    choice = table.choose(["A", "B"], loads, conversation)
    assert choice.ranks[0] == ["B"] and choice.decision == "prefix" and choice.matched_blocks == 4
    # Both hold the shared system prompt: the session's last replica breaks the tie, not load.
    table.record(RouteKey((), "session:x"), "A")
    tie = table.choose(["A", "B"], {"A": 2, "B": 0}, RouteKey(shared.blocks, "session:x"))
    assert tie.ranks[0] == ["A"] and tie.decision == "session"
    # No session: the less loaded of the equal holders.
    assert table.choose(["A", "B"], {"A": 2, "B": 0}, shared).ranks[0] == ["B"]


def test_saturated_preference_falls_back_to_least_loaded():
    table = AffinityTable(capacity=3)
    key = route_key(request(list(range(BLOCK_TOKENS * 2))))
    table.record(key, "A")
    assert table.choose(["A", "B"], {"A": 2, "B": 0}, key).ranks[0] == ["A"]  # busier, not full: stay
    spilled = table.choose(["A", "B"], {"A": 3, "B": 0}, key)
    assert spilled.ranks == [["B"], ["A"]] and spilled.decision == "least_loaded"
    # Every replica full: the prefix's holder still wins (it queues where the prefix is).
    assert table.choose(["A", "B"], {"A": 4, "B": 3}, key).ranks[0] == ["A"]


def test_new_prefixes_spread_by_load_and_agree_across_tables():
    key = route_key(request(list(range(1000, 1000 + BLOCK_TOKENS))))
    one, two = AffinityTable(), AffinityTable()
    assert one.choose(["A", "B"], {"A": 1, "B": 0}, key).ranks[0] == ["B"]
    # Equal loads: rendezvous hashing, so two frontends place a new prefix on the same replica.
    assert one.choose(["A", "B", "C"], {}, key).ranks == two.choose(["C", "B", "A"], {}, key).ranks


def test_forgotten_replica_holds_nothing_and_unroutable_candidates_are_skipped():
    table = AffinityTable()
    key = route_key(request(list(range(BLOCK_TOKENS * 2)), session="session:y"))
    table.record(key, "A")
    assert table.choose(["B", "C"], {"B": 1, "C": 0}, key).ranks[0] == ["C"]  # A is not a candidate
    table.forget("A")
    choice = table.choose(["A", "B"], {"A": 0, "B": 1}, key)
    assert choice.decision == "least_loaded" and choice.matched_blocks == 0


def test_table_is_bounded():
    table = AffinityTable(entries=8, sessions_kept=2)
    for n in range(10):
        table.record(route_key(request([n] * (BLOCK_TOKENS * 2), session=f"s{n}")), "A")
    assert len(table._blocks) == 8 and len(table._sessions) == 2
