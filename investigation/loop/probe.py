"""One probe turn per provider: is it reachable, does it take its dialect, is the reply valid?

``investigate providers check`` sends each provider of a providers file one real decision
request, built exactly as a case's first turn is: the system prompt, the turn header and
a context, with that turn's reply schema in the provider's dialect. The probe context
describes a small built-in snapshot (:func:`probe_snapshot`); the reply is read and
validated by the real contract and validator against it. Nothing is stored.

Verdicts (:class:`ProbeResult`): ``ok`` (a valid reply), ``invalid_reply`` (the server took
the request; the reply breaks the contract), ``refused`` (the server answered with an
error: a dialect or schema it cannot take (``PROVIDER_SCHEMA_REFUSED``), a context too
large, credentials, an address that is no chat-completions endpoint), ``timed_out`` (the
server took the connection but no complete reply came within ``timeout_s``: a model slower
than the bound, not a wrong address), ``unreachable`` (no HTTP answer: nothing listening, a
connect timeout, a connection reset), ``window_mismatch`` (a valid reply, but
``context_window_tokens`` is larger than the window the server says one request has:
vLLM's ``max_model_len``, llama.cpp's ``n_ctx`` per slot), ``not_sent`` (the request
never left: the API key's environment variable is not set, or holds whitespace inside the
key), ``skipped`` (a scripted provider), ``unreadable`` (a scripted provider whose reply
file cannot be read: ``PROVIDER_SCRIPT_UNREADABLE``).
"""

from __future__ import annotations

import os
import sqlite3
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from investigation.budget import BudgetManager
from investigation.cases.snapshot import DictSnapshot
from investigation.config import InvestigationConfig, ProviderConfig, canonical_json
from investigation.constants import PROMPT_VERSION, REPLY_SCHEMA_VERSION
from investigation.errors import ProviderError, TransientProviderError
from investigation.llm.dialects import canonical_dialect
from investigation.llm.openai import OpenAIProvider
from investigation.llm.scripted import count_script_lines
from investigation.llm.types import PROVIDER_CREDENTIALS_MISSING, ChatRequest
from investigation.loop.contract import ReplyRejected, read_reply
from investigation.loop.prompt import build_messages
from investigation.loop.reply_schema import turn_schema
from investigation.loop.validation import validate_reply
from investigation.text_safety import escape_text, url_for_display
from investigation.tools import ToolRouter

PROBE_REPORT = ("Orders with a discount are charged far too little: a 10% discount gives "
                "100% off.\n")
PROBE_SOURCE = {
    "shop/pricing.py": "def apply_discount(total, percent):\n"
                       "    return total - total * percent / 10\n",
    "shop/orders.py": "from shop.pricing import apply_discount\n\n"
                      "def order_total(order):\n"
                      "    return apply_discount(order['total'], order['discount'])\n",
}
PROBE_HYPOTHESES = [
    "apply_discount divides the percent by 10 instead of 100.",
    "The orders table stores discounts as fractions, not percents.",
]


def probe_snapshot() -> DictSnapshot:
    """The probe's snapshot: two source files, an orders database and a log."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "shop.sqlite"
        conn = sqlite3.connect(path)
        conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, total REAL, "
                     "discount INTEGER)")
        conn.executemany("INSERT INTO orders VALUES (?, ?, ?)",
                         [(1, 100.0, 10), (2, 50.0, 0)])
        conn.commit()
        conn.close()
        db = path.read_bytes()
    return DictSnapshot(
        source={p: t.encode() for p, t in PROBE_SOURCE.items()}, report=PROBE_REPORT,
        dbs={"shop.sqlite": db}, logs={"app.log": b"INFO order 1 total=0.0 discount=10\n"})


def probe_context(router: ToolRouter, snapshot: DictSnapshot,
                  config: InvestigationConfig) -> dict[str, Any]:
    """A first-turn context of hypothesis 1 of the probe case (the shape of
    ``loop.context.build``)."""
    budget = BudgetManager(config.budget, config.loop)
    credit = config.budget.credit_units
    return {
        "contract": {"prompt_version": PROMPT_VERSION, "schema_version": REPLY_SCHEMA_VERSION},
        "case": {"case_id": "probe", "revision": 1, "step_seq": 1, "package_id": "probe",
                 "report": snapshot.report_text(), "report_truncated": False,
                 "snapshot": {"source_files": len(snapshot.source_paths()),
                              "databases": snapshot.db_names(),
                              "tables": router.table_names(),
                              "log_files": len(snapshot.log_paths())}},
        "interpretation": {"summary": "Discounted order totals are wrong by a factor of ten."},
        "hypothesis": {"id": 1, "statement": PROBE_HYPOTHESES[0], "confidence": "unassessed",
                       "balance_units": credit, "credit_units": credit, "iterations": 0,
                       "max_iterations": config.loop.max_iterations_per_hypothesis,
                       "turn": 1, "deferred_by": None, "notes": []},
        "other_hypotheses": [{"id": 2, "statement": PROBE_HYPOTHESES[1], "status": "active",
                              "confidence": "unassessed", "turns": 0, "deferred_by": None}],
        "budget": budget.describe(),
        "external_tests": {"available": False, "kinds": [],
                           "deadline_seconds": config.loop.test_deadline_seconds},
        "early_diagnosis": {"enabled": config.loop.early_diagnosis,
                            "min_evidence": config.loop.early_diagnosis_min_evidence},
        "allowed_actions": ["query", "finish", "reject"],
        "closing_reason": None,
        "previous_result": None,
        "evidence": [],
        "questions": [],
        "last_rejection": None,
        "operations": router.describe(),
    }


@dataclass(frozen=True)
class ProbeResult:
    """What one provider did with the probe turn.

    Attributes:
        provider: its name; kind: ``openai`` or ``scripted``; dialect: canonical dialect.
        verdict: ``ok``, ``invalid_reply``, ``refused``, ``timed_out``, ``unreachable``,
            ``window_mismatch``, ``not_sent``, ``skipped`` or ``unreadable``.
        code: the rejection or provider error code (``None`` when ok).
        detail: the rejection detail or the provider's message (never secrets).
        seconds: wall time of the chat call's HTTP exchange (a configured tokenizer's
            count before it is not included).
        prompt_tokens, completion_tokens: usage the server reported.
        tokens_per_s: completion tokens per ``seconds``, when reported.
        action: the reply's ``next.action`` when it parsed.
        base_url: the address probed, a password in it masked (``None`` for a scripted
            provider).
        context_window_tokens: the window the providers file claims (``None``: none).
        served_window_tokens: the window the server says one request has, in tokens
            (``None``: it does not say, or the probe did not get that far).
        served_window_source: where the server said it.
        reply_excerpt: the start of the model's reply (at most
            :data:`REPLY_EXCERPT_CHARS` characters) when it was not valid: what the model
            wrote, beside why it was refused.
    """

    provider: str
    kind: str
    dialect: str | None
    verdict: str
    code: str | None = None
    detail: str | None = None
    seconds: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    tokens_per_s: float | None = None
    action: str | None = None
    base_url: str | None = None
    context_window_tokens: int | None = None
    served_window_tokens: int | None = None
    served_window_source: str | None = None
    reply_excerpt: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return asdict(self)


#: Failures raised before the request leaves this process (verdict ``not_sent``): the
#: API key's variable is unset or holds whitespace inside the key.
_NOT_SENT = frozenset({PROVIDER_CREDENTIALS_MISSING})
#: Provider errors where no HTTP answer came back: the address is the suspect.
_NO_ANSWER = frozenset({"PROVIDER_UNREACHABLE", "PROVIDER_TIMEOUT", "PROVIDER_NETWORK_ERROR",
                        "PROVIDER_REQUEST_DROPPED"})
#: Dialects that send the server no reply schema (``llm.dialects``).
SCHEMA_FREE_DIALECTS = frozenset({"json_object", "none"})
#: Rejections of a reply's shape, which a schema sent to the server would have prevented.
_SHAPE_CODES = frozenset({"REPLY_NOT_JSON", "REPLY_SCHEMA_INVALID", "REPLY_DUPLICATE_KEYS"})
#: httpx timeouts that happen before a connection is made: the address does not answer.
_BEFORE_CONNECTING = frozenset({"ConnectTimeout", "PoolTimeout"})


def _no_answer_verdict(exc: TransientProviderError) -> str:
    """``timed_out`` for a timeout after the connection was made (a read or write bound,
    or the total bound, which runs out after the connect bound of the same length could
    have), else ``unreachable``: a real model's user read "reachable NO" for a model that
    took longer than ``timeout_s`` on a CPU, and went looking for a wrong address."""
    if exc.code == "PROVIDER_TIMEOUT" and \
            exc.details.get("exception") not in _BEFORE_CONNECTING:
        return "timed_out"
    return "unreachable"


#: Characters of an invalid reply kept in :attr:`ProbeResult.reply_excerpt`.
REPLY_EXCERPT_CHARS = 1000


def _shown(base_url: str | None) -> str | None:
    """``base_url`` as output may show it: a password in it masked."""
    return None if base_url is None else url_for_display(base_url)


#: Characters of a listed model name :func:`model_note` shows (names are ids or paths).
MODEL_NAME_SHOWN = 400


def model_note(model: str, served: list[str] | None) -> str | None:
    """A note when the server's model list (``served``; ``None``: it lists none) does not
    hold ``model``: a server that serves one model (llama.cpp, llama-cpp-python) answers a
    request for any name, so a misspelt or stale ``model`` passes the probe and every
    case's record names a model that never answered. A listed ``model:tag`` (Ollama)
    holds ``model``."""
    if not served or model in served or any(m.startswith(model + ":") for m in served):
        return None
    # Whole names, to copy into the providers file (llama-cpp-python lists the model
    # file's path: cut at 80 characters it ended "SmolLM2-13", a real model's user).
    shown = ", ".join(repr(escape_text(m if len(m) <= MODEL_NAME_SHOWN
                                       else m[:MODEL_NAME_SHOWN] + "…")) for m in served[:5])
    more = f" and {len(served) - 5} more" if len(served) > 5 else ""
    return (f"the server lists {shown}{more} but not model = {escape_text(model)!r}: it "
            "answered anyway (a server that serves one model answers to any name); set "
            "`model` to a listed name so that each record names the model that answered")


def truncation_advice(config: ProviderConfig, prompt_tokens: int | None,
                      completion_tokens: int | None) -> str:
    """Why a probe reply was cut (``finish_reason`` ``length``) and what to change. A
    reply shorter than ``max_tokens`` was cut by the server's context window, not by
    ``max_tokens``: a llama-cpp-python server started without ``--n_ctx`` (a 2048-token
    window) cut the probe at prompt 1974 + reply 74 tokens, and "raise max_tokens" sent
    a real model's user round in circles."""
    used = (f" (prompt {prompt_tokens} + reply {completion_tokens} = "
            f"{prompt_tokens + completion_tokens} tokens)"
            if prompt_tokens is not None and completion_tokens is not None else "")
    window = ("start the server with a larger window (llama.cpp and llama-cpp-python: "
              "--n_ctx; a case's prompts grow to several thousand tokens) and set "
              "context_window_tokens to it")
    if config.max_tokens is None:
        return (f"the reply was cut{used}, and max_tokens is not set: the server's own "
                f"default or its context window ended it; set max_tokens, and if that "
                f"does not help, {window}")
    if completion_tokens is not None and completion_tokens < config.max_tokens:
        return (f"the reply was cut after {completion_tokens} tokens, before max_tokens = "
                f"{config.max_tokens}{used}: the server's context window ended it; {window}")
    return f"the reply was cut at max_tokens = {config.max_tokens}{used}; raise max_tokens"


def window_finding(claimed: int | None, served: tuple[int, str] | None,
                   not_believed: str | None = None) -> tuple[bool, str | None]:
    """Whether the claimed window (``context_window_tokens``) contradicts the one the
    server says a request has (``(tokens, where)``), and what to say: a claim larger
    than the server's window fails (the probe's prompt of about 2,000 tokens passed, and
    the server refused a case's longer requests in the middle of the case); no claim
    where the server says its window is a note (the engine cannot fit requests to a
    window it is not told); a claim the server does not confirm is a note."""
    if served is None:
        if claimed is None:
            return False, None
        if not_believed is not None:  # ``OpenAIProvider.window_not_believed``
            return False, (f"the server's stated window ({not_believed}) is not believed, "
                           f"so context_window_tokens = {claimed} is not checked")
        return False, (f"the server does not say its context window, so "
                       f"context_window_tokens = {claimed} is not checked (llama-cpp-python: "
                       "--n_ctx; Ollama: num_ctx)")
    size, where = served
    if claimed is None:
        return False, (f"the server's context window is {size} tokens ({where}); set "
                       f"context_window_tokens = {size} so that each request is fitted "
                       "within it before it is sent")
    if claimed > size:
        return True, (f"context_window_tokens = {claimed}, but the server's window is "
                      f"{size} tokens ({where}): a case's requests grow past this probe's, "
                      f"and the server would refuse those over {size} tokens in the middle "
                      f"of the case; set context_window_tokens = {size}, or serve the "
                      "model with a larger window")
    return False, None


def probe_provider(config: ProviderConfig, env: dict[str, str] | None = None,
                   policy: InvestigationConfig | None = None,
                   base_dir: str | Path = ".") -> ProbeResult:
    """Send one probe turn to ``config`` (see the module docstring); never raises for what
    the provider does. A scripted provider is not probed; its file must be readable
    (relative paths resolve against ``base_dir``, the providers file's directory), else
    ``unreadable`` with ``PROVIDER_SCRIPT_UNREADABLE`` (it said ``unreachable``, of a file:
    a trial)."""
    if config.kind != "openai":
        script = Path(base_dir) / (config.path or "")
        try:
            lines = count_script_lines(script)
        except (OSError, ValueError) as exc:
            return ProbeResult(config.name, config.kind, None, "unreadable",
                               "PROVIDER_SCRIPT_UNREADABLE",
                               f"cannot read the reply file {script}: "
                               f"{getattr(exc, 'strerror', None) or exc}")
        return ProbeResult(config.name, config.kind, None, "skipped",
                           detail=f"scripted replies are not probed; {script} has "
                                  f"{lines} line(s)")
    policy = policy or InvestigationConfig()
    dialect = canonical_dialect(config.structured_output)
    snapshot = probe_snapshot()
    router = ToolRouter(snapshot, policy.tools)
    try:
        context = probe_context(router, snapshot, policy)
        data = canonical_json(context)
        request = ChatRequest(messages=build_messages(data),
                              response_schema=turn_schema(context,
                                                          policy.loop
                                                          .max_questions_per_hypothesis),
                              schema_name="investigation_reply", call_index=0,
                              case_id="probe", metadata={"case_id": "probe"})
        provider = OpenAIProvider(config, env if env is not None else dict(os.environ))
        started = time.monotonic()

        def call_seconds() -> float:
            # The chat call's own exchange: the configured tokenizer's count before it
            # (a server round trip, or a wait until timeout_s) is not the model's time.
            taken = provider.last_exchange_s
            return round(time.monotonic() - started if taken is None else taken, 3)

        try:
            reply = provider.send(provider.build_request_bytes(request), request)
        except TransientProviderError as exc:
            verdict = _no_answer_verdict(exc) if exc.code in _NO_ANSWER else "refused"
            return ProbeResult(config.name, config.kind, dialect, verdict, exc.code,
                               exc.message, call_seconds(), base_url=_shown(config.base_url))
        except ProviderError as exc:
            # A key that is not set stops the request before any connection: the server
            # was never asked (neither reachable nor refusing).
            verdict = "not_sent" if exc.code in _NOT_SENT else "refused"
            return ProbeResult(config.name, config.kind, dialect, verdict, exc.code,
                               exc.message, call_seconds(), base_url=_shown(config.base_url))
        seconds = call_seconds()
        rate = (round(reply.completion_tokens / seconds, 1)
                if reply.completion_tokens and seconds > 0 else None)

        def result(verdict: str, code: str | None = None, detail: str | None = None,
                   action: str | None = None) -> ProbeResult:
            return ProbeResult(config.name, config.kind, dialect, verdict, code, detail,
                               seconds, reply.prompt_tokens, reply.completion_tokens, rate,
                               action, _shown(config.base_url), config.context_window_tokens,
                               served_window_tokens=served[0] if served else None,
                               served_window_source=served[1] if served else None,
                               reply_excerpt=reply.content[:REPLY_EXCERPT_CHARS]
                               if verdict == "invalid_reply" else None)

        served: tuple[int, str] | None = None

        try:
            parsed, _ = read_reply(reply.content)
            action = parsed.next.action
            validate_reply(parsed, context, policy.budget, router,
                           policy.loop.max_questions_per_hypothesis)
        except ReplyRejected as rej:
            if rej.code == "REPLY_NOT_JSON" and reply.finish_reason == "length":
                rej = ReplyRejected("REPLY_TRUNCATED", truncation_advice(
                    config, reply.prompt_tokens, reply.completion_tokens))
            elif dialect in SCHEMA_FREE_DIALECTS and rej.code in _SHAPE_CODES:
                # The model had only the prompt to follow (a real model's user read the
                # missing fields with no word on why).
                rej = ReplyRejected(rej.code, f"{rej.detail}; structured_output = "
                                    f"{dialect!r} sends the server no schema, so the model "
                                    "follows the prompt alone: a dialect that sends the "
                                    "reply schema constrains it (llama.cpp and "
                                    "llama-cpp-python: \"llama_cpp\"; vLLM: \"vllm\"; OpenAI: "
                                    "\"openai\")")
            return result("invalid_reply", rej.code, rej.detail)
        # The configured tokenizer failed: the window was checked by the estimate.
        notes = [provider.tokenizer_note()] if provider.tokenizer_failure else []
        if (model := model_note(config.model or "", provider.served_models())) is not None:
            notes.append(model)
        served = provider.served_window()
        mismatch, window = window_finding(config.context_window_tokens, served,
                                          provider.window_not_believed)
        if mismatch:
            return result("window_mismatch", "PROVIDER_WINDOW_MISMATCH", window, action)
        if window is not None:
            notes.append(window)
        return result("ok", detail="; ".join(notes) or None, action=action)
    finally:
        router.close()
