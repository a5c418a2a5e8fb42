"""CrewAI's token_usage → AIP usage, prices and costs (host/ledger/usage.py, docs/observing.md "Observing actions")."""

from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aip_crewai.host.ledger.usage import (
    MAX_COUNT,
    MAX_MODELS,
    ModelPrice,
    Pricing,
    SettingError,
    TokenCounts,
    amount,
    cost_picos,
    measure,
    parse_pricing,
    token_counts,
)

CREWAI_USAGE = {
    "total_tokens": 150,
    "prompt_tokens": 100,
    "cached_prompt_tokens": 40,
    "completion_tokens": 50,
    "successful_requests": 3,
}
PRICING = {
    "currency": "USD",
    "models": {"gpt-4o-mini": {"prompt": "0.15", "completion": "0.60", "cached_prompt": "0.075"}},
    "crews": {"triage": "gpt-4o-mini"},
}


def test_a_run_output_maps_every_crewai_usage_field():
    assert token_counts({"raw": "x", "token_usage": CREWAI_USAGE}) == TokenCounts(100, 50, 150, 40, 3)


def test_batch_run_outputs_are_summed():
    output = {"results": [{"token_usage": CREWAI_USAGE}, {"token_usage": {"prompt_tokens": 1}}, "junk"], "count": 2}
    assert token_counts(output) == TokenCounts(101, 50, 150, 40, 3)


@pytest.mark.parametrize("output", [None, "text", {"raw": "x"}, {"token_usage": "zero"}, {"results": []}])
def test_an_output_without_token_usage_has_no_tokens(output):
    assert token_counts(output) is None


@pytest.mark.parametrize("bad", [-1, 1.5, True, "7", None, MAX_COUNT + 1])
def test_a_count_that_is_not_a_bounded_natural_number_reads_as_zero(bad):
    assert token_counts({"token_usage": {"prompt_tokens": bad, "completion_tokens": MAX_COUNT}}) == TokenCounts(
        0, MAX_COUNT
    )


@given(st.dictionaries(st.text(max_size=30), st.one_of(st.integers(), st.floats(), st.text(), st.none()), max_size=8))
def test_any_token_usage_object_gives_bounded_natural_counts(usage):
    counts = token_counts({"token_usage": usage})
    assert counts is not None and all(0 <= v <= MAX_COUNT for v in counts.as_tuple())


def test_cost_bills_cached_prompt_tokens_at_their_own_price_exactly():
    pricing = parse_pricing(PRICING, ["triage"])
    assert pricing is not None
    measured = measure({"token_usage": CREWAI_USAGE}, crew_id="triage", latency_ms=1234, pricing=pricing)
    # 60 uncached × 0.15/1M + 40 cached × 0.075/1M + 50 × 0.60/1M = 0.000042
    assert measured.cost_picos == 42_000_000
    assert measured.usage.cost is not None and measured.usage.cost.amount == "0.000042"
    assert measured.usage.cost.currency == "USD" and measured.usage.cost.model == "gpt-4o-mini"
    assert measured.usage.latency_ms == 1234


def test_an_unpriced_crew_has_tokens_and_latency_but_no_cost():
    pricing = parse_pricing(PRICING, ["triage", "other"])
    measured = measure({"token_usage": CREWAI_USAGE}, crew_id="other", latency_ms=-5, pricing=pricing)
    assert measured.usage.cost is None and measured.cost_picos is None
    assert measured.usage.tokens == TokenCounts(100, 50, 150, 40, 3) and measured.usage.latency_ms == 0


_PRICE = st.decimals(min_value=0, max_value=999_999, places=6)


@given(st.integers(0, 10**9), st.integers(0, 10**9), st.integers(0, 10**9), _PRICE, _PRICE, _PRICE)
def test_cost_equals_the_decimal_arithmetic_exactly(prompt, cached, completion, p_in, p_cached, p_out):
    """Prices have at most 6 decimals per million tokens, so a cost in picos is exact."""
    tokens = TokenCounts(prompt=prompt, completion=completion, cached=cached)
    part = min(cached, prompt)
    expected = ((prompt - part) * p_in + part * p_cached + completion * p_out) / Decimal(10**6)
    picos = cost_picos(tokens, ModelPrice(p_in, p_out, p_cached, "EUR"))
    assert Decimal(picos) / Decimal(10**12) == expected
    assert Decimal(amount(picos)) == expected


@pytest.mark.parametrize(
    ("picos", "text"), [(0, "0"), (1, "0.000000000001"), (10**12, "1"), (1_500_000_000_000, "1.5")]
)
def test_amounts_are_plain_decimal_strings(picos, text):
    assert amount(picos) == text


@pytest.mark.parametrize("price", ["0.1234567", "1e3", "-1", "1,5", 0.15, "1000000", ""])
def test_a_price_is_a_decimal_string_with_at_most_six_decimals(price):
    raw = {"models": {"m": {"prompt": price, "completion": "1"}}}
    with pytest.raises(SettingError) as caught:
        parse_pricing(raw, [])
    assert caught.value.key == "pricing.models.m.prompt"


def test_the_price_bounds_at_their_edge_are_accepted():
    pricing = parse_pricing({"models": {"m": {"prompt": "999999.999999", "completion": "0"}}}, [])
    assert pricing is not None and pricing.models["m"].prompt == Decimal("999999.999999")
    assert pricing.models["m"].cached_prompt == pricing.models["m"].prompt  # default: the prompt price


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"models": {}, "crews": {"nope": "m"}}, "pricing.crews.nope"),
        ({"models": {}, "crews": {"triage": "missing"}}, "pricing.crews.triage"),
        ({"currency": "usd"}, "pricing.currency"),
        ({"cost": 1}, "pricing.cost"),
        ({"models": {"m": {"prompt": "1", "completion": "1", "extra": "1"}}}, "pricing.models.m"),
        ({"models": {"m": {"prompt": "1", "completion": "1", "currency": "EURO"}}}, "pricing.models.m.currency"),
    ],
)
def test_pricing_mistakes_are_named_by_key(raw, key):
    with pytest.raises(SettingError) as caught:
        parse_pricing(raw, ["triage"])
    assert caught.value.key == key


def test_at_most_max_models_are_accepted():
    models = {f"m{i}": {"prompt": "1", "completion": "1"} for i in range(MAX_MODELS)}
    assert len(parse_pricing({"models": models}, []).models) == MAX_MODELS
    models["one-more"] = {"prompt": "1", "completion": "1"}
    with pytest.raises(SettingError):
        parse_pricing({"models": models}, [])


def test_no_pricing_table_means_no_pricing():
    assert parse_pricing(None, ["triage"]) is None
    assert Pricing({}, {}).for_crew("triage") is None
