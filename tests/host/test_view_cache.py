"""The host's cache of final job views: what is final, both bounds, LRU order, disabled at 0.

The property test runs under the suite's Hypothesis profile (``ci``: derandomized, tests/conftest.py).
"""

from collections import OrderedDict

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aip_crewai.host.sidecars.view_cache import DEFAULT_ENTRIES, DEFAULT_MAX_BYTES, ViewCache, is_final_view

TIMEOUT_ERROR = {"status": "failed", "error_type": "ExecutionTimeout", "message": "too long", "uncertain_outcome": True}


def key(n: int, tenant: str = "acme") -> tuple[str, str, str]:
    return (tenant, "crew", f"run{n}")


@pytest.mark.parametrize(
    "view, final",
    [
        ({"status": "completed", "output": {"raw": "x"}}, True),
        ({"status": "failed", "error": {"error_type": "ValueError"}}, True),
        ({"status": "failed", "error": {"error_type": "SidecarRestarted"}}, True),
        ({"status": "failed"}, True),
        # a timed-out job's worker is still being stopped: provider_stop_observed is written later
        ({"status": "failed", "error": TIMEOUT_ERROR}, False),
        ({"status": "failed", "error": TIMEOUT_ERROR, "provider_stop_observed": True}, True),
        ({"status": "failed", "error": TIMEOUT_ERROR, "provider_stop_observed": False}, True),
        ({"status": "cancelled", "provider_stop_observed": True, "uncertain_outcome": False}, True),
        ({"status": "cancelled", "provider_stop_observed": None, "uncertain_outcome": True}, False),
        ({"status": "cancelled", "provider_stop_observed": False, "uncertain_outcome": True}, False),
        ({"status": "cancelled"}, False),
        ({"status": "running"}, False),
        ({"status": "queued"}, False),
        ({"status": "pending_approval"}, False),
        ({}, False),
        (None, False),
        ("completed", False),
        ([{"status": "completed"}], False),
    ],
)
def test_only_views_that_can_never_change_are_final(view, final):
    assert is_final_view(view) is final


def test_defaults():
    cache = ViewCache()
    assert (cache.max_entries, cache.max_bytes) == (DEFAULT_ENTRIES, DEFAULT_MAX_BYTES) == (1024, 4 * 1024 * 1024)
    assert cache.enabled and len(cache) == 0 and cache.total_bytes == 0


def test_get_after_put_and_counts():
    cache = ViewCache(4, 100)
    assert cache.get(key(1)) is None
    assert cache.put(key(1), b"one")
    assert cache.get(key(1)) == b"one"
    assert (cache.hits, cache.misses) == (1, 1)
    assert cache.get(key(1, tenant="globex")) is None  # another tenant's key never answers this entry


def test_entry_bound_at_limit_and_one_past_it_evicts_the_least_recently_used():
    cache = ViewCache(3, 1000)
    for n in range(3):
        cache.put(key(n), b"v%d" % n)
    assert len(cache) == 3 and cache.keys() == [key(0), key(1), key(2)]
    cache.get(key(0))  # now the most recent: key(1) is the least recently used
    cache.put(key(3), b"v3")
    assert len(cache) == 3 and cache.keys() == [key(2), key(0), key(3)]
    assert cache.get(key(1)) is None and cache.total_bytes == 6


def test_byte_bound_at_limit_and_one_past_it():
    cache = ViewCache(10, 10)
    assert cache.put(key(1), b"x" * 4) and cache.put(key(2), b"y" * 6)
    assert cache.total_bytes == 10 and len(cache) == 2  # exactly at the bound: both kept
    assert cache.put(key(3), b"z")  # one byte past it: the least recently used goes
    assert cache.keys() == [key(2), key(3)] and cache.total_bytes == 7


def test_a_view_larger_than_the_byte_bound_is_not_kept():
    cache = ViewCache(10, 10)
    assert cache.put(key(1), b"x" * 10)  # at the bound: kept
    assert not cache.put(key(2), b"x" * 11)  # past it: not kept, and nothing else is evicted for it
    assert cache.keys() == [key(1)] and cache.total_bytes == 10


def test_replacing_an_entry_counts_its_bytes_once():
    cache = ViewCache(10, 10)
    cache.put(key(1), b"abcd")
    cache.put(key(2), b"ef")
    cache.put(key(1), b"ghijkl")
    assert cache.get(key(1)) == b"ghijkl" and cache.total_bytes == 8 and cache.keys() == [key(2), key(1)]
    assert not cache.put(key(1), b"x" * 11)  # a refused replacement drops the older bytes too
    assert cache.get(key(1)) is None and cache.total_bytes == 2


@pytest.mark.parametrize("entries, max_bytes", [(0, 100), (5, 0)])
def test_disabled_at_zero(entries, max_bytes):
    cache = ViewCache(entries, max_bytes)
    assert not cache.enabled
    assert not cache.put(key(1), b"")
    assert cache.get(key(1)) is None and len(cache) == 0 and cache.total_bytes == 0


@pytest.mark.parametrize("entries, max_bytes", [(-1, 10), (10, -1)])
def test_negative_bounds_are_refused(entries, max_bytes):
    with pytest.raises(ValueError):
        ViewCache(entries, max_bytes)


operations = st.lists(st.tuples(st.sampled_from(["put", "get"]), st.integers(0, 7), st.integers(0, 12)), max_size=60)


@given(max_entries=st.integers(0, 5), max_bytes=st.integers(0, 24), ops=operations)
def test_bounds_hold_and_the_cache_behaves_as_a_reference_lru(max_entries, max_bytes, ops):
    """After every call: both bounds hold, the byte count is exact, and the cache matches a
    reference LRU (a get after a put of an entry that fits answers its bytes unless evicted)."""
    cache = ViewCache(max_entries, max_bytes)
    model: OrderedDict[tuple[str, str, str], bytes] = OrderedDict()
    for op, n, size in ops:
        k = key(n)
        if op == "put":
            value = bytes([n]) * size
            model.pop(k, None)
            fits = max_entries > 0 and max_bytes > 0 and size <= max_bytes
            if fits:
                model[k] = value
                while len(model) > max_entries or sum(map(len, model.values())) > max_bytes:
                    model.popitem(last=False)
            assert cache.put(k, value) is fits
            if fits:
                assert cache.get(k) == value  # get after put
                model.move_to_end(k)
        else:
            expected = model.get(k)
            if expected is not None:
                model.move_to_end(k)
            assert cache.get(k) == expected
        assert len(cache) <= max_entries and cache.total_bytes <= max_bytes
        assert cache.total_bytes == sum(map(len, model.values()))
        assert cache.keys() == list(model)
