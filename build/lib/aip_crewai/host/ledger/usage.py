"""Token usage, latency and cost of an action (pure): CrewAI's ``token_usage`` → AIP ``Usage``.

A crew operation's output carries CrewAI's ``UsageMetrics`` as ``token_usage`` (``prompt_tokens``,
``completion_tokens``, ``total_tokens``, ``cached_prompt_tokens``, ``successful_requests``);
``batch_run``'s output carries one per item (``{"results": [output, ...]}``), which are summed. A count
that is not a non-negative integer of at most :data:`MAX_COUNT` is read as 0 (the sidecar's output is
data, never trusted to be well formed).

Cost needs prices: ``[pricing]`` in ``host.toml`` names a price per million tokens for each model, as a
decimal string, and the model each crew runs (``[pricing.crews]``: the host never sees CrewAI, and a
crew's output does not name its model). Costs are exact integers of :data:`PICO` (10^-12 of the
currency unit) and rendered as decimal strings. Cached prompt tokens are a part of ``prompt_tokens``
(OpenAI's ``cached_tokens``) billed at ``cached_prompt`` (default: the ``prompt`` price).

Source: docs/observing.md "Observing actions" (usage and cost); AIP 1.0 ``ActionResult.usage``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import msgspec

#: Largest token or request count read from an output (JSON-safe integers).
MAX_COUNT = 2**53 - 1
#: Cost unit: 10^-12 of the currency unit.
PICO = 10**12
#: A price per million tokens: a decimal string, at most 6 digits before and 6 after the point.
PRICE_PATTERN = re.compile(r"^(0|[1-9][0-9]{0,5})(\.[0-9]{1,6})?\Z")
#: An ISO 4217-like currency code.
CURRENCY_PATTERN = re.compile(r"^[A-Z]{3}\Z")
#: At most this many priced models and crew → model entries.
MAX_MODELS = 256
#: CrewAI ``UsageMetrics`` field → :class:`TokenCounts` field.
USAGE_FIELDS = {
    "prompt_tokens": "prompt",
    "completion_tokens": "completion",
    "total_tokens": "total",
    "cached_prompt_tokens": "cached",
    "successful_requests": "requests",
}
#: Token kinds, the ``kind`` label of the tokens counter and the keys of ``usage.tokens``.
TOKEN_KINDS = ("prompt", "completion", "total", "cached", "requests")


class TokenCounts(msgspec.Struct, frozen=True):
    """Token counts of one action (``usage.tokens``); ``cached`` is part of ``prompt``."""

    prompt: int = 0
    completion: int = 0
    total: int = 0
    cached: int = 0
    requests: int = 0

    def __add__(self, other: TokenCounts) -> TokenCounts:
        return TokenCounts(*(min(MAX_COUNT, a + b) for a, b in zip(self.as_tuple(), other.as_tuple(), strict=True)))

    def as_tuple(self) -> tuple[int, int, int, int, int]:
        """``(prompt, completion, total, cached, requests)``."""
        return (self.prompt, self.completion, self.total, self.cached, self.requests)


def _count(value: Any) -> int:
    return value if type(value) is int and 0 <= value <= MAX_COUNT else 0


def _one(usage: Any) -> TokenCounts | None:
    if not isinstance(usage, Mapping):
        return None
    return TokenCounts(**{name: _count(usage.get(key)) for key, name in USAGE_FIELDS.items()})


def token_counts(output: Any) -> TokenCounts | None:
    """The token counts of an operation's output, or None when it carries no ``token_usage``.

    Args:
        output: a completed crew operation's output: ``{"token_usage": {...}, ...}``, or
            ``{"results": [{"token_usage": ...}, ...]}`` (``batch_run``: summed).
    """
    if not isinstance(output, Mapping):
        return None
    found = _one(output.get("token_usage"))
    results = output.get("results")
    if found is None and isinstance(results, list):
        items = [c for c in (_one(r.get("token_usage")) for r in results if isinstance(r, Mapping)) if c is not None]
        if items:
            found = sum(items[1:], items[0])
    return found


@dataclass(frozen=True)
class ModelPrice:
    """Prices of one model per million tokens, in ``currency`` (``cached_prompt``: of cached prompt tokens)."""

    prompt: Decimal
    completion: Decimal
    cached_prompt: Decimal
    currency: str


@dataclass(frozen=True)
class Pricing:
    """``[pricing]``: ``models`` (model key → price) and ``crews`` (crew id → model key)."""

    models: Mapping[str, ModelPrice]
    crews: Mapping[str, str]

    def for_crew(self, crew_id: str) -> tuple[str, ModelPrice] | None:
        """``(model key, price)`` of the model ``crew_id`` runs, or None (no model named or no price)."""
        model = self.crews.get(crew_id)
        price = self.models.get(model) if model is not None else None
        return (model, price) if model is not None and price is not None else None


def _per_token_picos(price_per_million: Decimal) -> int:
    """Price of one token in picos: exact, as prices have at most 6 decimals (PICO / 10^6 = 10^6)."""
    return int(price_per_million * (PICO // 1_000_000))


def cost_picos(tokens: TokenCounts, price: ModelPrice) -> int:
    """Cost of ``tokens`` at ``price``, in picos (exact): uncached prompt, cached prompt and completion
    tokens each at their price. ``cached`` beyond ``prompt`` is read as all of ``prompt`` cached."""
    cached = min(tokens.cached, tokens.prompt)
    return (
        (tokens.prompt - cached) * _per_token_picos(price.prompt)
        + cached * _per_token_picos(price.cached_prompt)
        + tokens.completion * _per_token_picos(price.completion)
    )


def amount(picos: int) -> str:
    """``picos`` as a plain decimal string of the currency unit, e.g. ``"0.0000225"``, ``"3"``."""
    text = format(Decimal(picos).scaleb(-12), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


class Cost(msgspec.Struct, frozen=True):
    """``usage.cost``: ``{amount, currency, model}`` (``amount``: a decimal string)."""

    amount: str
    currency: str
    model: str


class Usage(msgspec.Struct, frozen=True, omit_defaults=True):
    """AIP ``Usage``: ``{tokens?, latency_ms?, cost?}``."""

    tokens: TokenCounts | None = None
    latency_ms: int | None = None
    cost: Cost | None = None


@dataclass(frozen=True)
class Measured:
    """One action's usage as computed (the stored row's values): ``cost_picos`` None without a price."""

    usage: Usage
    tokens: TokenCounts | None
    cost_picos: int | None
    currency: str | None


def measure(output: Any, *, crew_id: str, latency_ms: int, pricing: Pricing | None) -> Measured:
    """The usage of one crew operation's result.

    Args:
        output: the result's output (see :func:`token_counts`); None for a failure.
        crew_id: the action's crew (for its price).
        latency_ms: from the action's acceptance to its result, milliseconds (negative: 0).
        pricing: the operator's prices, or None.
    """
    tokens = token_counts(output)
    priced = pricing.for_crew(crew_id) if pricing is not None and tokens is not None else None
    picos = cost_picos(tokens, priced[1]) if priced is not None and tokens is not None else None
    cost = Cost(amount(picos), priced[1].currency, priced[0]) if priced is not None and picos is not None else None
    usage = Usage(tokens=tokens, latency_ms=max(0, latency_ms), cost=cost)
    return Measured(usage, tokens, picos, priced[1].currency if priced is not None else None)


class SettingError(ValueError):
    """A ``[pricing]`` entry or a receipt key setting is invalid: ``key`` names it
    (``pricing.models.gpt-4o.prompt``, ``host.receipt_key_file``); the host config reports it keyed."""

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"{key}: {reason}")


def _price(key: str, value: Any) -> Decimal:
    if not isinstance(value, str) or not PRICE_PATTERN.match(value):
        raise SettingError(key, 'must be a decimal string per million tokens, e.g. "0.15" (at most 6 decimals)')
    return Decimal(value)


def parse_pricing(raw: Any, crew_ids: Iterable[str]) -> Pricing | None:
    """``[pricing]`` of ``host.toml`` → :class:`Pricing` (None when absent).

    Shape::

        [pricing]
        currency = "USD"                      # default for every model
        [pricing.models."gpt-4o-mini"]        # the model key: any name up to 128 characters
        prompt = "0.15"                       # per million tokens, decimal string
        completion = "0.60"
        cached_prompt = "0.075"               # optional, default: prompt
        currency = "USD"                      # optional, default: [pricing] currency
        [pricing.crews]
        triage = "gpt-4o-mini"                # admitted crew id -> model key

    Raises:
        SettingError: an unknown key, a price not a decimal string, an unknown crew or model, over
            :data:`MAX_MODELS` entries.
    """
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise SettingError("pricing", "must be a table")
    unknown = set(raw) - {"currency", "models", "crews"}
    if unknown:
        raise SettingError(f"pricing.{sorted(unknown)[0]}", "unknown key")
    currency = raw.get("currency", "USD")
    if not isinstance(currency, str) or not CURRENCY_PATTERN.match(currency):
        raise SettingError("pricing.currency", 'must be a three-letter currency code such as "USD"')
    models_raw, crews_raw = raw.get("models", {}), raw.get("crews", {})
    if not isinstance(models_raw, Mapping) or not isinstance(crews_raw, Mapping):
        raise SettingError("pricing", "models and crews must be tables")
    if len(models_raw) > MAX_MODELS or len(crews_raw) > MAX_MODELS:
        raise SettingError("pricing", f"at most {MAX_MODELS} models and {MAX_MODELS} crews")
    models: dict[str, ModelPrice] = {}
    for name, table in models_raw.items():
        key = f"pricing.models.{name}"
        if not 1 <= len(name) <= 128 or not isinstance(table, Mapping):
            raise SettingError(key, "a model key is 1..128 characters naming a table")
        extra = set(table) - {"prompt", "completion", "cached_prompt", "currency"}
        if extra or "prompt" not in table or "completion" not in table:
            raise SettingError(key, "needs prompt and completion (cached_prompt and currency optional), nothing else")
        own = table.get("currency", currency)
        if not isinstance(own, str) or not CURRENCY_PATTERN.match(own):
            raise SettingError(f"{key}.currency", 'must be a three-letter currency code such as "USD"')
        prompt = _price(f"{key}.prompt", table["prompt"])
        cached = _price(f"{key}.cached_prompt", table["cached_prompt"]) if "cached_prompt" in table else prompt
        models[name] = ModelPrice(prompt, _price(f"{key}.completion", table["completion"]), cached, own)
    known = set(crew_ids)
    crews: dict[str, str] = {}
    for crew_id, model in crews_raw.items():
        if crew_id not in known:
            raise SettingError(f"pricing.crews.{crew_id}", "is not an admitted crew id")
        if model not in models:
            raise SettingError(f"pricing.crews.{crew_id}", f"{model!r} is not a model of [pricing.models]")
        crews[crew_id] = model
    return Pricing(models, crews)
