"""Model tokens and money: reserved before each call, settled after, reported per hypothesis.

Token usage and money are separate from investigation units (seed 000, "Budget and
stopping": "Model token usage and monetary metrics remain separate from investigation
units"). Money is kept in integer *micros* (millionths) of ``limits.currency``, so
accumulation is exact; a provider's ``input_price_per_mtok`` / ``output_price_per_mtok``
(price per million tokens) is exactly its price per token in micros.

Before each attempt of a priced provider the gateway reserves the call's worst case::

    prompt_estimate = ceil(request_bytes / bytes_per_token)   # the whole body: a hosted
                                                              # API bills the schema too
    reserved = ceil(prompt_estimate * input_price) + ceil(max_tokens * output_price)

where ``max_tokens`` is the provider's output budget, lowered so the reservation fits what
the case's cap (``limits.max_model_cost``) leaves; below :data:`MIN_OUTPUT_TOKENS` the call
is refused (``MODEL_COST_CAP_REACHED``, the case blocks ``MODEL_COST_CAP``). While a cap is
set, a provider without prices is not used (``PROVIDER_PRICE_UNKNOWN``). After the
attempt the reservation is settled (:func:`settled_micros`): nothing when the request never
left this process; the usage the server reports (each count clamped to what the request
allows) when it reports some; nothing for an error answer without usage; the reservation
when no answer came (the server may have done the work) or a completion came without
usable usage.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam
from sqlalchemy import select as sa_select
from sqlmodel import Session, col, func, select

from investigation import jsonio
from investigation.config import ProviderConfig
from investigation.llm.tokens import output_budget
from investigation.store.models import LLMAttempt, LLMOperation

#: Smallest output budget worth a call under a money cap (tokens).
MIN_OUTPUT_TOKENS = 64
#: Micros in one unit of currency.
MICROS = 1_000_000
#: The case's model spending reached its cap.
MODEL_COST_CAP_REACHED = "MODEL_COST_CAP_REACHED"
#: A money cap is set and the provider states no prices.
PROVIDER_PRICE_UNKNOWN = "PROVIDER_PRICE_UNKNOWN"
#: ``limits.currency`` differs from the currency the case's costs were recorded in.
MODEL_COST_CURRENCY_CHANGED = "MODEL_COST_CURRENCY_CHANGED"


def to_micros(amount: float) -> int:
    """An amount of currency in micros (rounded down: a cap never grows by rounding)."""
    return math.floor(amount * MICROS)


def priced(config: ProviderConfig) -> bool:
    """Whether the provider states both prices."""
    return config.input_price_per_mtok is not None and config.output_price_per_mtok is not None


def cost_micros(config: ProviderConfig, prompt_tokens: int, completion_tokens: int) -> int:
    """What ``prompt_tokens`` in and ``completion_tokens`` out cost at the provider's prices."""
    assert config.input_price_per_mtok is not None and config.output_price_per_mtok is not None
    return (math.ceil(prompt_tokens * config.input_price_per_mtok)
            + math.ceil(completion_tokens * config.output_price_per_mtok))


@dataclass(frozen=True)
class CallBudget:
    """The money side of one attempt.

    Attributes:
        reserved_micros: the worst case reserved before sending.
        max_tokens: the output cap to send (the provider's, or lower to fit the cap).
    """

    reserved_micros: int
    max_tokens: int


def prompt_estimate(config: ProviderConfig, request_bytes: bytes) -> int:
    """The worst-case prompt tokens of a request: its whole body at ``bytes_per_token``."""
    return math.ceil(len(request_bytes) / config.bytes_per_token)


def plan_call(config: ProviderConfig, prompt_tokens: int,
              remaining_micros: int | None) -> CallBudget | None:
    """Reserve an attempt of a priced provider; ``None`` when the cap leaves too little.

    Args:
        config: the provider (priced).
        prompt_tokens: the request's :func:`prompt_estimate`.
        remaining_micros: what the case's cap leaves, or ``None`` without a cap.
    """
    prompt = prompt_tokens
    want = output_budget(config)
    prompt_cost = cost_micros(config, prompt, 0)
    assert config.output_price_per_mtok is not None
    if remaining_micros is not None:
        left = remaining_micros - prompt_cost
        per_token = config.output_price_per_mtok
        affordable = want if per_token == 0 else (
            math.floor(left / per_token) if left > 0 else 0)
        want = min(want, affordable)
        if want < MIN_OUTPUT_TOKENS:
            return None
    return CallBudget(prompt_cost + cost_micros(config, 0, want), want)


@dataclass(frozen=True)
class Attempted:
    """What an attempt sent and got, for its settlement.

    Attributes:
        request_bytes: the size of the request sent (bounds the prompt tokens a server
            can truthfully report: a token covers at least one byte).
        max_tokens: the output cap sent, if any (bounds the completion tokens).
        sent: whether the request left this process (a refusal before sending, a
            connection that never opened, a key that is not set: nothing was sent).
        answered: whether an HTTP answer came back.
        succeeded: whether it was a chat completion.
        prompt_tokens, completion_tokens: usage the server reported, if any.
    """

    request_bytes: int
    max_tokens: int | None
    sent: bool
    answered: bool
    succeeded: bool
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


def settled_micros(config: ProviderConfig, reserved: int | None, attempt: Attempted
                   ) -> int | None:
    """What a finished attempt cost; ``None`` if the provider is unpriced.

    Reported usage (of a success, or of an answer that refused) is charged, each count
    clamped to what the request allows (prompt tokens to its bytes, completion tokens to
    its ``max_tokens``): a server cannot bill past what it was sent. An attempt never sent
    costs nothing, an error answer without usage nothing, an attempt without an answer
    and a completion without usable usage their reservation (the server did, or may
    have done, the work).
    """
    if not priced(config):
        return None
    if not attempt.sent:
        return 0
    if attempt.prompt_tokens is not None and attempt.completion_tokens is not None:
        prompt = min(attempt.prompt_tokens, attempt.request_bytes)
        completion = attempt.completion_tokens if attempt.max_tokens is None \
            else min(attempt.completion_tokens, attempt.max_tokens)
        return cost_micros(config, prompt, completion)
    if attempt.answered and not attempt.succeeded:
        return 0
    # No answer, or a completion without plausible usage (missing, negative, NaN): the
    # server did the work; its worst case is charged, so a server that reports no usage
    # cannot spend past the cap.
    return reserved


def usage_of(raw: bytes | None) -> tuple[int | None, int | None]:
    """``(prompt_tokens, completion_tokens)`` of an answer body that is not a completion
    (a refusal can still report usage), or ``(None, None)``."""
    if not raw or len(raw) > 1 << 20:
        return None, None
    try:
        doc = jsonio.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None, None
    return usage_in(doc)


def usage_in(doc: Any) -> tuple[int | None, int | None]:
    """``(prompt_tokens, completion_tokens)`` of a parsed answer's ``usage``, or
    ``(None, None)``; counts as ``openai.parse_chat_completion`` reads them."""
    usage = doc.get("usage") if isinstance(doc, dict) else None
    if not isinstance(usage, dict):
        return None, None

    def count(value: Any) -> int | None:
        ok = type(value) is int and 0 <= value < 2**31
        return value if ok else None

    return count(usage.get("prompt_tokens")), count(usage.get("completion_tokens"))


def case_spent_micros(s: Session, case_id: str) -> int:
    """Money the case's model calls cost or hold reserved (in-flight attempts), in micros."""
    charged = func.coalesce(LLMAttempt.cost_micros, LLMAttempt.reserved_micros, 0)
    total = s.exec(select(func.coalesce(func.sum(charged), 0))
                   .join(LLMOperation, col(LLMOperation.id) == col(LLMAttempt.operation_id))
                   .where(LLMOperation.case_id == case_id)).one()
    return int(total)


def case_currency(s: Session, case_id: str) -> str | None:
    """The currency the case's priced model attempts recorded (decision 180: one per case;
    the first one's), or ``None`` when none recorded one (no priced attempt yet, or only
    attempts priced before migration ``0012_attempt_currency``). What ``status``, the
    report and summary.md label the case's costs with, whatever configuration the reader
    has."""
    return s.exec(select(LLMAttempt.currency)
                  .join(LLMOperation, col(LLMOperation.id) == col(LLMAttempt.operation_id))
                  .where(LLMOperation.case_id == case_id,
                         col(LLMAttempt.currency).is_not(None))
                  .order_by(col(LLMAttempt.id)).limit(1)).first()


def cost_label(s: Session, case_id: str, configured: str) -> str:
    """The label of the case's model costs: :func:`case_currency`, else ``configured``
    (``limits.currency`` of the configuration read)."""
    return case_currency(s, case_id) or configured


_ATTEMPTS = LLMAttempt.__table__.c  # type: ignore[attr-defined]
_OPERATIONS = LLMOperation.__table__.c  # type: ignore[attr-defined]
#: Every attempt of a case with its decision's hypothesis (plain rows, built once).
_USAGE = sa_select(_OPERATIONS.hypothesis_id, _ATTEMPTS.status, _ATTEMPTS.prompt_tokens,
                   _ATTEMPTS.completion_tokens, _ATTEMPTS.cost_micros).join_from(
    LLMAttempt.__table__, LLMOperation.__table__,  # type: ignore[attr-defined]
    _OPERATIONS.id == _ATTEMPTS.operation_id).where(
    _OPERATIONS.case_id == bindparam("case_id"))


def usage_by_hypothesis(s: Session, case_id: str) -> dict[int | None, dict[str, Any]]:
    """Per hypothesis (``None``: calls recorded before hypotheses were tracked): model
    ``calls`` (answered decisions), ``attempts`` (every request sent, failed ones too),
    ``awaiting_answer`` (of those, sent and not answered yet: a call in flight, or one
    whose process died, closed when its grace runs out), ``prompt_tokens``, ``completion_tokens`` (sums of what servers reported),
    ``tokens_reported`` (attempts whose server reported a count: 0 means the token sums
    say nothing, as with a scripted provider), ``prompt_tokens_reported`` and
    ``completion_tokens_reported`` (the same for each count alone: a server may report
    one and not the other) and ``cost_micros`` (``None`` when no
    attempt was priced: null in ``status --json``, where a reader took -1 for an amount)."""
    rows = s.connection().execute(_USAGE, {"case_id": case_id}).all()
    out: dict[int | None, dict[str, Any]] = {}
    for hid, status, prompt, completion, cost in rows:
        entry = out.setdefault(hid, {"calls": 0, "attempts": 0, "awaiting_answer": 0,
                                     "prompt_tokens": 0, "completion_tokens": 0,
                                     "tokens_reported": 0, "prompt_tokens_reported": 0,
                                     "completion_tokens_reported": 0, "cost_micros": None})
        entry["attempts"] += 1
        entry["calls"] += status == "succeeded"
        entry["awaiting_answer"] += status == "sent"
        entry["tokens_reported"] += prompt is not None or completion is not None
        entry["prompt_tokens_reported"] += prompt is not None
        entry["completion_tokens_reported"] += completion is not None
        entry["prompt_tokens"] += prompt or 0
        entry["completion_tokens"] += completion or 0
        if cost is not None:
            entry["cost_micros"] = (entry["cost_micros"] or 0) + cost
    return out


def partial_tokens_text(reported: int, calls: int) -> str:
    """`` (246 of 247 calls)`` after a token sum when some answered calls came without
    counts (the sum is partial: readers took it for the whole), else ``""``."""
    return f" ({reported} of {calls} calls)" if 0 < reported < calls else ""


def token_cells(usage: Iterable[Mapping[str, Any]]) -> tuple[str, str]:
    """The prompt and the completion token sums over :func:`usage_by_hypothesis` entries,
    as the status, summary and report show them: ``"not reported"`` when no server
    reported that count (a scripted provider: never a 0), else the sum, followed by
    :func:`partial_tokens_text` of the calls that reported that very count (a server may
    report one count and not the other: a hostile trial read "(1 of 3 calls)" under a
    column no call had reported)."""
    rows = list(usage)
    calls = sum(int(u["calls"]) for u in rows)
    cells = []
    for name in ("prompt_tokens", "completion_tokens"):
        reported = sum(int(u[f"{name}_reported"]) for u in rows)
        cells.append(f"{sum(int(u[name]) for u in rows)}"
                     f"{partial_tokens_text(reported, calls)}" if reported else "not reported")
    return cells[0], cells[1]


def format_money(micros: int, currency: str) -> str:
    """``micros`` as an amount with six decimals and the currency, e.g. ``0.001250 USD``."""
    return f"{micros / MICROS:.6f} {currency}"


def cost_text(micros: int | None, currency: str) -> str:
    """:func:`format_money`, or ``"not priced"`` for ``None`` (no attempt had a price)."""
    return "not priced" if micros is None else format_money(micros, currency)


def priced_total(usage: Iterable[Mapping[str, Any]]) -> int | None:
    """The sum of ``cost_micros`` over :func:`usage_by_hypothesis` entries, ``None`` when
    none was priced."""
    priced = [u["cost_micros"] for u in usage if u["cost_micros"] is not None]
    return sum(priced) if priced else None
