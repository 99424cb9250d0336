"""Secrets in a case: refused when a package is built, masked before a model sees them.

Two uses, two costs, one source of rules: Yelp's detect-secrets (a maintained scanner).

**At build** (:func:`scan_files`, ``investigate case build``): every name and every
line of every text file packed (report, ``source/``, ``logs/``) is checked with the
run-time rules below, and the lines they flag are also scanned with detect-secrets
itself, its file-type aware plugins and false-positive filters
(``SecretsCollection.scan_file``), with every default plugin except the two high-entropy
detectors and the public-IP detector. Its Python patterns are super-linear on crafted
lines, so it sees at most :data:`MAX_DETECT_SECRETS_LINES` lines of at most
:data:`MAX_DETECT_SECRETS_LINE` characters per build.

**At run time** (:class:`SecretMasker`, every tool result): detect-secrets' regex
detectors (AWS, GitHub, GitLab, Slack, Stripe, OpenAI, private keys, basic-auth URLs,
JWTs, ... every ``RegexBasedDetector`` it ships) and its keyword list applied to
assignments (``password = "..."``, ``API_KEY=...``, ``"secret": "..."``) on each quoted
line or value, plus the lines inside a PEM private key block, and database columns whose
name holds such a keyword. Each secret is replaced by ``[secret masked: <type>]``: the
same input always gives the same output, so fingerprints and novelty stay stable.

What is not caught is written down in ``docs/operations.md`` ("Secrets"): high-entropy
strings without a keyword or a known format, a password that is a plain word, secrets
split over lines (other than PEM blocks), encoded or computed secrets, and anything a
model can learn by *computing* over a database value in SQL (``substr``, comparisons).
Every rule applied to untrusted text runs on RE2 (linear time). Searches never match on
masked text (a pattern that only matches through a secret
finds nothing), so a search cannot be used to guess a secret.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import re2

__all__ = ["MASK", "MAX_MASKED_CHARS", "SecretFinding", "SecretMasker", "default_masker",
           "mask_marker", "private_key_lines", "scan_database_schema", "scan_files"]

#: What replaces a secret (``{type}`` is detect-secrets' secret type, e.g. "AWS Access Key").
MASK = "[secret masked: {type}]"
#: Longest text masked in one piece (characters). A longer line or value is masked and
#: shown only up to this length (what findings quote is cut to ``tools.max_line_bytes``,
#: at most 8,192 bytes, well inside it), so masking stays bounded on a crafted 30 MB line.
MAX_MASKED_CHARS = 12_288
#: Lines of at most this many characters are cached (at most :data:`_CACHED_LINES`).
_CACHED_CHARS = 1024
_CACHED_LINES = 4096
#: Keyword hits of one kind that are not secrets (templates, references, placeholders).
_PLACEHOLDER = re2.compile(
    r"(?i)^(?:\$\{?.*|%\(.*|\{\{.*|<.*>|\*+|x+|\.+|-+|none|null|nil|true|false|undefined|"
    r"changeme|required|optional|string|str|secret|password|example|your[_-].*)$")
#: A bare (unquoted) value made of letters, underscores and dots only is a reference or
#: a plain word (``password = settings.PASSWORD``, ``secret = get_secret``), not masked.
_REFERENCE = re2.compile(r"^[A-Za-z_][A-Za-z_.]*$")
#: Plugins left out at both stages: entropy alone flags every hash, UUID and base64 blob
#: of a source tree (the build would always be refused), and a public IP is evidence.
_EXCLUDED_PLUGINS = ("Base64HighEntropyString", "HexHighEntropyString", "IPPublicDetector")


def mask_marker(secret_type: str) -> str:
    """The text that replaces one secret of ``secret_type``."""
    return MASK.format(type=secret_type)


@dataclass(frozen=True)
class SecretFinding:
    """One secret found while building a package (the secret itself is never kept).

    Attributes:
        path: the package entry name (``source/.env``).
        line: 1-based line number; 0 when the secret is in the entry's name or, with
            ``where``, in a database's schema.
        type: detect-secrets' secret type ("Secret Keyword", "AWS Access Key", ...).
        where: for a database: which schema object holds it (``"schema object 3
            (table)"``: its position in ``sqlite_master``, never its name).
    """

    path: str
    line: int
    type: str
    where: str = ""

    def __str__(self) -> str:
        path = default_masker().mask(self.path)[0]  # a name may be the secret itself
        if self.where:
            return f"{path}: {self.type} in {self.where}"
        if self.line == 0:
            return f"{path}: {self.type} in the file name"
        return f"{path}:{self.line}: {self.type}"


# -- rules ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Rules:
    detectors: tuple[tuple[str, Any], ...]
    """(secret type, RE2 pattern) of every regex detector detect-secrets ships."""
    keyword: Any
    """RE2: a denylisted keyword, a separator and a quoted or bare value."""
    prefilter: Any
    """An RE2 set of all of them (index ``len(detectors)`` is the keyword rule): one
    linear pass tells which rules can match a text at all."""
    plugin_names: tuple[str, ...]


#: detect-secrets' patterns use a few constructs RE2 lacks; each has a linear equivalent
#: for masking (a boundary character is consumed instead of looked at).
_RE2_REWRITES = (
    (re.compile(r"\(\?:\(\?<=\\W\)\|\(\?<=\^\)\)"), r"(?:^|\\W)"),
    (re.compile(r"\(\?!\\w\)"), r"(?:\\W|$)"),
    (re.compile(r"\(\?!\[([^\]]+)\]\)"), r"(?:[^\1]|$)"),
    (re.compile(r"\{(\d+),1024\}"), r"{\1,1000}"),
)


def _linear(pattern: re.Pattern[str]) -> str | None:
    """``pattern`` rewritten for RE2 (linear time on any line; case-insensitivity inline),
    or ``None`` when it uses something RE2 cannot express even after
    :data:`_RE2_REWRITES`."""
    text = pattern.pattern
    for construct, linear in _RE2_REWRITES:
        text = construct.sub(linear, text)
    if pattern.flags & re.VERBOSE and re.search(r"\s|#", text):
        return None
    if pattern.flags & re.IGNORECASE:
        text = f"(?i:{text})"
    try:
        re2.compile(text, _re2_options())
    except re2.error:
        return None
    return text


def _re2_options() -> Any:
    options = re2.Options()
    options.log_errors = False
    return options


@lru_cache(maxsize=1)
def _rules() -> _Rules:
    from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class
    from detect_secrets.plugins.base import RegexBasedDetector
    from detect_secrets.plugins.keyword import DENYLIST

    detectors: list[tuple[str, str]] = []
    names: list[str] = []
    plugins: list[tuple[str, Any]] = sorted(get_mapping_from_secret_type_to_class().items())
    for secret_type, cls in plugins:
        if cls.__name__ in _EXCLUDED_PLUGINS:
            continue
        names.append(cls.__name__)
        if issubclass(cls, RegexBasedDetector):
            detector: Any = cls  # abstract in detect-secrets' type hints
            for pattern in detector().denylist:
                linear = _linear(pattern)
                if linear is None:  # pragma: no cover - every shipped pattern compiles
                    raise RuntimeError(f"{cls.__name__}: {pattern.pattern!r} has no "
                                       "linear-time form; extend _RE2_REWRITES")
                detectors.append((secret_type, linear))
    words = "|".join(DENYLIST)
    key = rf"[\w.\-]*(?:{words})[\w.\-]*"
    separator = r"[\"'\]]{0,2}\s*(?::=|=>|==|!=|=|:|>)\s*@?"  # ">": <password>x</password>
    value = (r"(?:\"([^\"\n]{4,256})\"|'([^'\n]{4,256})'|`([^`\n]{4,256})`"
             r"|([^\s\"'`,;()\[\]{}<>]{6,256}))")
    keyword = rf"(?i:(?:^|[^\w.\-])({key}){separator}{value})"
    prefilter = re2.Set.SearchSet(_re2_options())
    for _, linear in detectors:
        prefilter.Add(linear)
    prefilter.Add(keyword)
    prefilter.Compile()
    return _Rules(
        detectors=tuple((secret_type, re2.compile(linear, _re2_options()))
                        for secret_type, linear in detectors),
        keyword=re2.compile(keyword, _re2_options()),
        prefilter=prefilter,
        plugin_names=tuple(sorted(names)),
    )


# -- run time ---------------------------------------------------------------------------------


class SecretMasker:
    """Masks secrets in tool findings (see the module docstring for the rules).

    Deterministic and thread-safe; results are cached per line (bounded).
    """

    def __init__(self) -> None:
        self._rules = _rules()
        self._cache: dict[str, tuple[str, int]] = {}
        self._lock = threading.Lock()

    def mask(self, text: str) -> tuple[str, int]:
        """``text`` with every secret replaced by its marker.

        Args:
            text: one line (a line break inside is scanned like any character).

        Returns:
            ``(masked text, number of secrets masked)``; ``text`` itself when none.
        """
        with self._lock:
            hit = self._cache.get(text)
        if hit is not None:
            return hit
        result = self._mask(text)
        if len(text) <= _CACHED_CHARS:  # the cache stays within a few MiB
            with self._lock:
                if len(self._cache) >= _CACHED_LINES:
                    self._cache.clear()
                self._cache[text] = result
        return result

    def _mask(self, text: str) -> tuple[str, int]:
        spans = self.spans(text)
        if not spans:
            return text, 0
        out, position = [], 0
        for start, end, secret_type in spans:
            out += [text[position:start], mask_marker(secret_type)]
            position = end
        out.append(text[position:])
        return "".join(out), len(spans)

    def spans(self, text: str) -> list[tuple[int, int, str]]:
        """``(start, end, secret type)`` of every secret in ``text``, sorted, overlaps
        merged (the first type is kept). Linear in ``len(text)``."""
        rules = self._rules
        hits = rules.prefilter.Match(text)
        if not hits:
            return []
        found: list[tuple[int, int, str]] = []
        for index in sorted(hits):
            if index == len(rules.detectors):
                continue
            secret_type, pattern = rules.detectors[index]
            for match in pattern.finditer(text):
                # A pattern's first group is the secret when it is long enough to be one
                # (an AWS secret key); a short one is a prefix (``ghp``): mask it all.
                value = match.group(1) if pattern.groups else None
                start, end = match.span(1 if value and len(value) >= 8 else 0)
                if end > start:
                    found.append((start, end, secret_type))
        if len(rules.detectors) in hits:
            for match in rules.keyword.finditer(text):
                keyword = match.group(1)
                for group in (2, 3, 4, 5):
                    secret = match.group(group)
                    if secret is None:
                        continue
                    if _PLACEHOLDER.match(secret.strip()) or secret.strip().lower() == \
                            keyword.lower() or (group == 5
                                                and _REFERENCE.match(secret.rstrip(":."))):
                        break
                    found.append((*match.span(group), "Secret Keyword"))
                    break
        merged: list[tuple[int, int, str]] = []
        for start, end, secret_type in sorted(found):
            if merged and start < merged[-1][1]:
                last = merged[-1]
                merged[-1] = (last[0], max(last[1], end), last[2])
            else:
                merged.append((start, end, secret_type))
        return merged

    def mask_prefix(self, text: str) -> tuple[str, int]:
        """:meth:`mask` of ``text`` cut to :data:`MAX_MASKED_CHARS` (the part a finding
        can quote); the rest is dropped, never shown unmasked."""
        return self.mask(text[:MAX_MASKED_CHARS])

    def mask_names(self, value: Any) -> tuple[Any, int]:
        """``value`` (JSON) with secrets masked in every dict key and every string
        (recursively); counts only strings that changed, so masking text that was masked
        already counts nothing. For identifiers and short fields (paths, table and column
        names, error messages); long texts go through :meth:`mask_prefix`."""
        if isinstance(value, str):
            shown, n = self.mask_prefix(value)
            return (shown, n) if shown != value else (value, 0)
        if isinstance(value, list):
            out, total = [], 0
            for item in value:
                shown, n = self.mask_names(item)
                out.append(shown)
                total += n
            return out, total
        if isinstance(value, dict):
            masked: dict[Any, Any] = {}
            total = 0
            for key, item in value.items():
                shown_key, n = self.mask_names(key) if isinstance(key, str) else (key, 0)
                shown, m = self.mask_names(item)
                masked[shown_key] = shown
                total += n + m
            return masked, total
        return value, 0

    def mask_lines(self, lines: list[str]) -> tuple[list[str], int]:
        """Mask each line; the lines of a PEM private key block (from its ``BEGIN ...
        PRIVATE KEY`` line to its ``END`` line) are masked whole."""
        inside = private_key_lines(lines)
        out, count = [], 0
        for number, line in enumerate(lines):
            if number in inside:
                out.append(mask_marker("Private Key"))
                count += 1
                continue
            shown, n = self.mask(line)
            out.append(shown)
            count += n
        return out, count

    def mask_value(self, column: str, value: str) -> tuple[str, int]:
        """A database text value: masked whole when its column name holds a keyword of
        the denylist (``password``, ``api_key``, ``secret``, ...) and it is no
        placeholder; otherwise by the line rules."""
        if _keyword_any().search(column) and len(value.strip()) >= 4 \
                and not _PLACEHOLDER.match(value.strip()):
            return mask_marker("Secret Keyword"), 1
        return self.mask_prefix(value)


@lru_cache(maxsize=1)
def _keyword_any() -> Any:
    """Any keyword of detect-secrets' ``KeywordDetector`` denylist (case-insensitive)."""
    from detect_secrets.plugins.keyword import DENYLIST

    return re2.compile("(?i)" + "|".join(DENYLIST))


@lru_cache(maxsize=1)
def default_masker() -> SecretMasker:
    """The process's shared masker (its line cache serves every case)."""
    return SecretMasker()


_PEM_BEGIN = re2.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----")
_PEM_END = re2.compile(r"-----END [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----")


def private_key_lines(lines: list[str]) -> set[int]:
    """0-based numbers of the lines that lie inside a PEM private key block, both marker
    lines included (an unterminated block runs to the end)."""
    if not any("PRIVATE KEY" in line for line in lines):
        return set()
    inside: set[int] = set()
    start: int | None = None
    for number, line in enumerate(lines):
        if start is None and _PEM_BEGIN.search(line):
            start = number
        if start is not None:
            inside.add(number)
            if _PEM_END.search(line):
                start = None
    return inside


# -- build ------------------------------------------------------------------------------------


_SCAN_LOCK = threading.Lock()
#: Lines handed to detect-secrets are at most this long, and at most
#: :data:`MAX_DETECT_SECRETS_LINES` of them per build: its Python patterns are
#: super-linear on crafted lines (about 25 ms for one 240-character line), so its cost
#: stays bounded whatever a tree holds. Every line is still checked by the linear rules.
MAX_DETECT_SECRETS_LINE = 200
MAX_DETECT_SECRETS_LINES = 2000


def scan_files(files: Mapping[str, Path], texts: Mapping[str, bytes]) -> list[SecretFinding]:
    """Scan a package's names and text files for secrets (see the module docstring).

    Every name and every line is checked with the run-time rules (:class:`SecretMasker`,
    linear), so whatever tool results would mask is reported here. Lines those rules'
    pre-check flags (at most :data:`MAX_DETECT_SECRETS_LINES`, each at most
    :data:`MAX_DETECT_SECRETS_LINE` characters) are also scanned by detect-secrets itself,
    with its file-type rules and filters, in a copy of their file that keeps the name and
    line numbers and blanks every other line.

    Args:
        files: package entry name -> file on disk.
        texts: package entry name -> the bytes that are packed (an entry that is not UTF-8
            text is skipped).

    Returns:
        Findings sorted by path and line (``line`` 0: the entry's name).
    """
    masker = default_masker()
    rules = _rules()
    found: set[SecretFinding] = set()
    wanted: dict[str, dict[int, str]] = {}
    budget = MAX_DETECT_SECRETS_LINES
    for name in sorted(files):
        found.update(SecretFinding(name, 0, kind) for *_, kind in masker.spans(name))
        try:
            text = texts[name].decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            continue
        if "\x00" in text or not rules.prefilter.Match(text):
            continue
        lines = text.split("\n")
        for number, line in enumerate(lines, start=1):
            if not rules.prefilter.Match(line):
                continue
            found.update(SecretFinding(name, number, kind) for *_, kind in masker.spans(line))
            if budget and len(line) <= MAX_DETECT_SECRETS_LINE:
                wanted.setdefault(name, {})[number] = line
                budget -= 1
        found.update(SecretFinding(name, number + 1, "Private Key")
                     for number in private_key_lines(lines))
    if wanted:
        found.update(_detect_secrets(files, wanted))
    return sorted(found, key=lambda f: (f.path, f.line, f.type))


def _detect_secrets(files: Mapping[str, Path],
                    wanted: Mapping[str, Mapping[int, str]]) -> set[SecretFinding]:
    """detect-secrets on copies of the files holding only the ``wanted`` lines."""
    import tempfile

    from detect_secrets.core.secrets_collection import SecretsCollection
    from detect_secrets.settings import default_settings, get_settings

    found: set[SecretFinding] = set()
    with tempfile.TemporaryDirectory(prefix="investigate-secrets-") as tmp, \
            _SCAN_LOCK, default_settings():
        get_settings().disable_plugins(*_EXCLUDED_PLUGINS)
        collection = SecretsCollection()
        by_path: dict[str, str] = {}
        for index, (name, lines) in enumerate(sorted(wanted.items())):
            copy = Path(tmp) / str(index) / Path(files[name]).name
            copy.parent.mkdir()
            last = max(lines)
            copy.write_text("\n".join(lines.get(n, "") for n in range(1, last + 1)) + "\n",
                            encoding="utf-8")
            by_path[str(copy)] = name
            collection.scan_file(str(copy))
        for filename, secret in collection:
            entry = by_path.get(filename) or by_path.get(str(Path(filename)))
            if entry is not None and secret.line_number:
                found.add(SecretFinding(entry, secret.line_number, secret.type))
    return found


def scan_database_schema(entry: str, data: bytes) -> list[SecretFinding]:
    """Secrets in a SQLite database's names and schema text: every ``sqlite_master`` row's
    name and SQL (tables, columns, indexes, views, triggers) with the run-time rules.

    Values are not scanned here (tool results mask them); names are, because they reach
    the context, the reply schema and every result that lists them. A file that SQLite
    cannot read gives no finding (the package validation refuses it).

    Args:
        entry: the package entry name (``db/app.sqlite``).
        data: the database file's bytes.

    Returns:
        Findings with ``where`` = the object's position in ``sqlite_master``.
    """
    import sqlite3

    masker = default_masker()
    conn = sqlite3.connect(":memory:")
    try:
        conn.deserialize(data)
        rows = conn.execute("SELECT type, name, sql FROM sqlite_master").fetchall()
    except (sqlite3.Error, OverflowError, ValueError):
        return []
    finally:
        conn.close()
    found: set[SecretFinding] = set()
    for position, (kind, name, sql) in enumerate(rows, start=1):
        where = f"schema object {position} ({kind})"
        for text in (name, sql):
            for line in text.split("\n") if isinstance(text, str) else ():
                found.update(SecretFinding(entry, 0, secret_type, where)
                             for *_, secret_type in masker.spans(line))
    return sorted(found, key=lambda f: (f.path, f.where, f.type))


def format_findings(findings: Iterable[SecretFinding], limit: int = 20) -> str:
    """A short listing for an error message: ``path:line: type`` (never the secret)."""
    items = list(findings)
    shown = "; ".join(str(f) for f in items[:limit])
    more = f"; and {len(items) - limit} more" if len(items) > limit else ""
    return shown + more
