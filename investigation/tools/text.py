"""Safe text handling for the snapshot tools: paths, globs, RE2 patterns, lines.

Model-supplied patterns never reach Python's backtracking :mod:`re`. Regular expressions
and globs are compiled with google-re2 (linear time, memory bounded by
:data:`RE2_MAX_MEM_BYTES`). Globs are translated to RE2 here (not with
:func:`fnmatch.translate`, whose output is a Python-``re`` pattern, nor with
``PurePosixPath.match``, which matches from the right and has no ``**``), so their
semantics are ours and documented:

* ``*`` matches any run of characters except ``/``; ``?`` one character except ``/``;
* ``**`` matches anything, including ``/``; ``**/`` also matches no directory at all;
* ``[abc]``, ``[a-z]``, ``[!abc]`` are character classes of one character (a negated
  class never matches ``/``); an unclosed ``[`` is literal;
* the glob is anchored at both ends; a glob without ``/`` is matched against the file name
  only (``*.py`` finds Python files at any depth), one with ``/`` against the whole path.

Lines are the ``\\n``-separated pieces of a file decoded as strict UTF-8; a ``\\r`` before
the newline stays part of the line (the snapshot's exact text).
"""

from __future__ import annotations

from typing import Any

import re2

from investigation.cases.textindex import decode_text
from investigation.errors import ToolError

__all__ = [
    "RE2_MAX_MEM_BYTES",
    "PathGlob",
    "check_pattern_length",
    "check_relative_path",
    "check_symbol",
    "compile_regex",
    "cut_text",
    "decode_text",
    "find_symbol",
    "glob_to_re2",
    "is_identifier_char",
    "re2_options",
    "split_lines",
]

#: Memory bound of one compiled RE2 program (pattern + DFA cache), in bytes.
RE2_MAX_MEM_BYTES = 8 << 20


def check_relative_path(value: str, argument: str, *, allow_empty: bool = False) -> None:
    """Refuse a path, prefix or glob that could name anything outside its root.

    Args:
        value: the model-supplied text.
        argument: the argument name, for the error message.
        allow_empty: accept ``""`` (``source.list`` prefix).

    Raises:
        ToolError: ``TOOL_PATH_ESCAPE`` for an absolute path, a ``..`` segment, a
            backslash, a NUL byte or a drive letter; ``TOOL_INVALID_ARGUMENTS`` for an
            empty value when not allowed.
    """
    if not value:
        if allow_empty:
            return
        raise ToolError("TOOL_INVALID_ARGUMENTS", f"{argument} must not be empty",
                        argument=argument)
    reason = None
    if "\x00" in value:
        reason = "contains a NUL byte"
    elif "\\" in value:
        reason = "contains a backslash (use / as separator)"
    elif value.startswith("/"):
        reason = "is absolute"
    elif len(value) >= 2 and value[1] == ":" and value[0].isascii() and value[0].isalpha():
        reason = "starts with a drive letter"
    elif any(part == ".." for part in value.split("/")):
        reason = "contains a '..' segment"
    if reason is not None:
        raise ToolError("TOOL_PATH_ESCAPE",
                        f"{argument} {reason}; give a path relative to the root",
                        argument=argument)


def check_pattern_length(value: str, argument: str, max_bytes: int) -> None:
    """Raise ``TOOL_PATTERN_TOO_LONG`` if ``value`` exceeds ``max_bytes`` UTF-8 bytes."""
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise ToolError("TOOL_PATTERN_TOO_LONG",
                        f"{argument} is {size} bytes; the limit is {max_bytes}",
                        argument=argument, size_bytes=size, max_bytes=max_bytes)


def re2_options() -> Any:
    """Fresh RE2 options of every model-supplied pattern (memory bound, no logging)."""
    options = re2.Options()
    options.max_mem = RE2_MAX_MEM_BYTES
    options.log_errors = False
    return options


def compile_regex(pattern: str, argument: str = "pattern") -> Any:
    """Compile a model-supplied regular expression with RE2.

    Returns:
        A compiled ``re2`` pattern (``.search(str)`` runs in linear time).

    Raises:
        ToolError: ``TOOL_REGEX_INVALID`` when RE2 refuses it (syntax, unsupported
            feature such as backreferences or lookaround, or over the memory bound).
    """
    try:
        return re2.compile(pattern, re2_options())
    except (re2.error, TypeError, ValueError) as exc:
        detail = exc.args[0] if exc.args else exc
        if isinstance(detail, bytes):
            detail = detail.decode("utf-8", "replace")
        raise ToolError("TOOL_REGEX_INVALID",
                        f"{argument} is not a valid RE2 expression: {detail}",
                        argument=argument) from exc


def _class_to_re2(glob: str, start: int) -> tuple[str, int] | None:
    """Translate the class opening at ``glob[start] == "["``; None if it never closes.

    Returns:
        ``(re2_class, index_after_class)``. A negated class never matches ``/``.
    """
    i = start + 1
    negate = i < len(glob) and glob[i] in "!^"
    if negate:
        i += 1
    body_start = i
    if i < len(glob) and glob[i] == "]":
        i += 1  # a leading ] is literal
    while i < len(glob) and glob[i] != "]":
        i += 1
    if i >= len(glob):
        return None
    body = glob[body_start:i]
    parts = [
        "-" if ch == "-" and 0 < pos < len(body) - 1 else re2.escape(ch)
        for pos, ch in enumerate(body)
    ]
    return ("[^/" if negate else "[") + "".join(parts) + "]", i + 1


def glob_to_re2(glob: str) -> str:
    """Translate a path glob into an anchored RE2 expression (see the module docstring)."""
    out = ["^"]
    i = 0
    n = len(glob)
    while i < n:
        ch = glob[i]
        if ch == "*":
            if glob.startswith("**", i):
                i += 2
                if i < n and glob[i] == "/":
                    out.append("(?:.*/)?")
                    i += 1
                else:
                    out.append(".*")
                continue
            out.append("[^/]*")
        elif ch == "?":
            out.append("[^/]")
        elif ch == "[":
            translated = _class_to_re2(glob, i)
            if translated is not None:
                text, i = translated
                out.append(text)
                continue
            out.append(re2.escape(ch))
        else:
            out.append(re2.escape(ch))
        i += 1
    out.append("$")
    return "".join(out)


class PathGlob:
    """A compiled path glob.

    Args:
        glob: the model-supplied glob (already checked for escapes and length).

    Raises:
        ToolError: ``TOOL_REGEX_INVALID`` if the translation does not compile.
    """

    def __init__(self, glob: str) -> None:
        self.glob = glob
        self._basename_only = "/" not in glob
        self._regex = compile_regex(glob_to_re2(glob), argument="path_glob")

    def matches(self, path: str) -> bool:
        """True if ``path`` (relative, POSIX) matches the glob."""
        target = path.rsplit("/", 1)[-1] if self._basename_only else path
        return self._regex.search(target) is not None


def split_lines(text: str) -> list[str]:
    """Lines of ``text`` split on ``\\n`` only; a final newline ends the last line."""
    if not text:
        return []
    lines = text.split("\n")
    if text.endswith("\n"):
        lines.pop()
    return lines


def cut_text(text: str, max_bytes: int) -> tuple[str, bool]:
    """Cut ``text`` to at most ``max_bytes`` UTF-8 bytes on a character boundary.

    Returns:
        ``(text, was_cut)``.
    """
    encoded = text.encode("utf-8", "surrogatepass")
    if len(encoded) <= max_bytes:
        return text, False
    return encoded[:max_bytes].decode("utf-8", "ignore"), True


def is_identifier_char(ch: str) -> bool:
    """Characters that continue an identifier (boundary test of ``symbol.occurrences``)."""
    return ch == "_" or ch.isalnum()


def check_symbol(symbol: str) -> None:
    """Refuse a symbol that is not an identifier-ish token.

    Raises:
        ToolError: ``TOOL_INVALID_ARGUMENTS`` unless ``symbol`` consists of ASCII
            letters, digits, ``_`` and ``.`` and holds at least one non-dot character.
    """
    ok = all(ch.isascii() and (ch.isalnum() or ch in "_.") for ch in symbol)
    if not ok or not symbol.strip("."):
        raise ToolError("TOOL_INVALID_ARGUMENTS",
                        "symbol must be an identifier: ASCII letters, digits, '_' and '.'",
                        argument="symbol")


def find_symbol(line: str, symbol: str) -> list[int]:
    """0-based columns (code points) of ``symbol`` in ``line`` at identifier boundaries."""
    columns: list[int] = []
    start = 0
    while True:
        col = line.find(symbol, start)
        if col < 0:
            return columns
        end = col + len(symbol)
        before_ok = col == 0 or not is_identifier_char(line[col - 1])
        after_ok = end >= len(line) or not is_identifier_char(line[end])
        if before_ok and after_ok:
            columns.append(col)
        start = col + 1
