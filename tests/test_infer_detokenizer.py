"""The incremental detokenizer: what it shows is never taken back, and ends as the whole text.

Each test feeds token ids (bytes) step by step and checks the texts a stream would see.
"""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stacklib.infer.detokenizer import IncrementalDetokenizer

MULTI_BYTE = "é→😀\u0800\U0010ffff"  # 2, 3, 4, 3 and 4 bytes


def _stream(ids, steps, stop=(), min_tokens=0):
    """Feed `ids` a step at a time (`steps`: tokens per step), the last step final.

    Returns the text shown after each step, and the stop string found (None if none).
    """
    detokenizer, shown, at = IncrementalDetokenizer(stop, min_tokens), [], 0
    for size in steps:
        chunk, at = ids[at:at + size], at + size
        found = detokenizer.update(chunk, final=at >= len(ids))
        shown.append(detokenizer.output_text(finished=found is not None or at >= len(ids)))
        if found is not None:
            return shown, found
    return shown, None


def _assert_never_taken_back(shown):
    for before, after in zip(shown, shown[1:], strict=False):
        assert after.startswith(before), (before, after)


def _splits(n, rng):
    """Step sizes that add up to n: ones, or random sizes up to 4."""
    sizes = []
    while sum(sizes) < n:
        sizes.append(min(rng.randint(1, 4), n - sum(sizes)))
    return sizes


@pytest.mark.parametrize("char", list(MULTI_BYTE))
def test_a_character_split_at_every_byte_is_shown_only_once_whole(char):
    text = f"a{char}b{char}"
    ids = list(text.encode())
    for cut in range(1, len(char.encode())):  # a split point inside the character
        steps = [1 + cut, len(ids) - 1 - cut]
        shown, _ = _stream(ids, steps)
        assert shown == ["a", text]
    shown, _ = _stream(ids, [1] * len(ids))  # every byte its own step
    assert "\ufffd" not in "".join(shown) and shown[-1] == text
    _assert_never_taken_back(shown)


def test_every_chunking_of_mixed_text_streams_exactly_the_text():
    text = "x = 'àé→😀'\n" * 3 + MULTI_BYTE
    ids, rng = list(text.encode()), random.Random(0)
    for _ in range(50):
        shown, _ = _stream(ids, _splits(len(ids), rng))
        _assert_never_taken_back(shown)
        assert shown[-1] == text and "\ufffd" not in "".join(shown)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([0x41, 0x0a, 0x80, 0xbf, 0xc3, 0xa9, 0xe2, 0x86, 0x92, 0xf0, 0x9f, 0x98,
                                 0xff, 0xc0, 0xed, 0xa0, 0xf4, 0x90]), min_size=1, max_size=16),
       st.randoms(use_true_random=False))
def test_any_bytes_stream_to_what_decoding_them_at_once_gives(ids, rng):
    shown, _ = _stream(ids, _splits(len(ids), rng))
    _assert_never_taken_back(shown)
    assert shown[-1] == bytes(ids).decode("utf-8", errors="replace")


def test_an_unfinished_character_at_the_end_becomes_one_replacement_character():
    ids = list("ok→".encode())[:-1]  # the arrow's last byte never came
    shown, _ = _stream(ids, [1] * len(ids))
    assert shown == ["o", "ok", "ok", "ok\ufffd"]


@pytest.mark.parametrize("stop", ["\n\n", "→x", "😀", "b→"])
def test_a_stop_string_across_tokens_is_found_and_nothing_of_it_or_after_is_shown(stop):
    text = f"ab→ {stop}tail"
    ids = list(text.encode())
    expected = text[:text.find(stop)]
    for steps in ([1] * len(ids), [3] * (len(ids) // 3 + 1)):
        shown, found = _stream(ids, steps, stop=[stop, "never"])
        assert found == stop and shown[-1] == expected
        _assert_never_taken_back(shown)
        assert all(expected.startswith(text) for text in shown)


def test_the_first_listed_stop_string_wins_and_a_longer_one_holds_back_more():
    ids = list(b"one two")
    shown, found = _stream(ids, [len(ids)], stop=["two", "one two"])
    assert (found, shown) == ("two", ["one "])
    detokenizer = IncrementalDetokenizer(["abcd"])
    detokenizer.update(list(b"xyzab"))
    assert detokenizer.output_text(finished=False) == "xy"  # "zab" could begin "abcd"
    assert detokenizer.output_text(finished=True) == "xyzab"


def test_stop_strings_before_min_tokens_do_not_count_but_one_that_ends_after_does():
    ids = list(b"a.b.c.")
    shown, found = _stream(ids, [1] * len(ids), stop=["."], min_tokens=3)
    assert (found, shown[-1]) == (".", "a.b")
    ids = list(b"xy:)z")  # ":)" starts in the 3rd token and ends in the 4th, the first searched
    shown, found = _stream(ids, [1] * len(ids), stop=[":)"], min_tokens=4)
    assert (found, shown[-1]) == (":)", "xy")
