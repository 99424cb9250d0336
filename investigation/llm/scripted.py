"""The scripted provider: replays recorded model replies from a JSON Lines file.

A real provider (demos, tests, reproducing a recorded investigation), not a test hack:
it goes through the same gateway, persistence and validation as an HTTP provider.

File format (DESIGN.md "Fixed interfaces"): JSON Lines, one reply per line, served in
order. Decisions made here:

* Line ``i`` (0-based, counting only non-blank lines) answers the decision call with
  ``ChatRequest.call_index == i``; a replayed case therefore gets the same reply for
  the same call however often a call is retried.
* Lines end with ``\\n`` or ``\\r\\n``; the terminator is not part of the reply.
  Whitespace-only lines are ignored. There are no comment lines: every other line is a
  reply, so any JSON Lines tool reads the file unchanged.
* A line is served as-is, even when it is not valid JSON or not a valid reply: the
  loop's validation judges it, so recorded invalid replies replay faithfully.
* The file is read on every call (it is small); nothing is cached between calls.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Iterator
from pathlib import Path

from investigation.config import ProviderConfig, canonical_json
from investigation.errors import ProviderConfigurationError
from investigation.files import MAX_SCRIPT_FILE_BYTES, read_bounded
from investigation.llm.types import (
    MAX_RESPONSE_BYTES,
    PROVIDER_BAD_CONFIG,
    PROVIDER_SCRIPT_EXHAUSTED,
    PROVIDER_SCRIPT_UNREADABLE,
    ChatRequest,
    ProviderReply,
)

_SCRIPT_IN_MESSAGE = re.compile(r"^provider '.*?': (?:cannot read script|script) (.+?)"
                                r"(?: has \d+ replies (?:but call|and the case's model call) |: )")


def script_path_of(message: str | None) -> str | None:
    """The reply file a ``PROVIDER_SCRIPT_EXHAUSTED`` / ``PROVIDER_SCRIPT_UNREADABLE``
    message of :class:`ScriptedProvider` names (its format is this module's), else
    ``None``. Lets guidance print the real file instead of a placeholder."""
    found = _SCRIPT_IN_MESSAGE.search(message or "")
    return found.group(1) if found else None


def iter_script_lines(data: bytes, path: str | Path = "") -> Iterator[tuple[int, bytes]]:
    """``(physical line number, bytes)`` of each reply line of a JSON Lines script, one at
    a time: exact bytes, terminators and blank lines dropped. What the scripted provider
    serves and ``investigate replies check`` judges. A list of every line of a 40 MB file
    of 20 million short lines took gigabytes (a hostile-input trial): callers keep only
    the lines they need.

    Raises:
        OSError: ``EFBIG`` for a reply line larger than
            :data:`~investigation.llm.types.MAX_RESPONSE_BYTES`, what an HTTP provider's
            response may be (naming its line number), when the iteration reaches it.
    """
    number, pos, size = 0, 0, len(data)
    while pos <= size:
        end = data.find(b"\n", pos)
        if end < 0:
            end = size
        number += 1
        stop = end - 1 if end > pos and data[end - 1:end] == b"\r" else end
        if stop - pos > MAX_RESPONSE_BYTES:
            raise OSError(errno.EFBIG, f"reply line {number} is larger than "
                          f"{MAX_RESPONSE_BYTES} bytes, what a model server's response "
                          "may be", str(path))
        line = data[pos:stop]
        if line.strip():
            yield number, line
        pos = end + 1


def script_lines(data: bytes, path: str | Path = "") -> list[tuple[int, bytes]]:
    """Every reply line of a script (:func:`iter_script_lines`) as a list.

    Raises:
        OSError: ``EFBIG`` for a reply line that is too large.
    """
    return list(iter_script_lines(data, path))


def read_script_lines(path: Path) -> list[bytes]:
    """The reply lines of the script at ``path`` (:func:`script_lines`), a regular file of
    at most :data:`~investigation.files.MAX_SCRIPT_FILE_BYTES`.

    Raises:
        OSError: the file cannot be read, is not a regular file, or is too large; a reply
            line is too large.
    """
    return [line for _, line in script_lines(read_bounded(path, MAX_SCRIPT_FILE_BYTES), path)]


def count_script_lines(path: Path) -> int:
    """How many reply lines the script at ``path`` holds (:func:`iter_script_lines`),
    without keeping them.

    Raises:
        OSError: as :func:`read_script_lines`.
    """
    return sum(1 for _ in iter_script_lines(read_bounded(path, MAX_SCRIPT_FILE_BYTES), path))


class ScriptedProvider:
    """Serves reply line ``call_index`` of a JSON Lines file.

    Args:
        config: the provider entry (``kind = "scripted"``, ``path`` required).
        base_dir: directory a relative ``config.path`` resolves against (the providers
            file's directory).

    Raises:
        ProviderConfigurationError: ``PROVIDER_BAD_CONFIG`` when ``path`` is missing.
    """

    def __init__(self, config: ProviderConfig, base_dir: str | Path) -> None:
        if not config.path:
            raise ProviderConfigurationError(
                PROVIDER_BAD_CONFIG,
                f"provider {config.name!r}: a scripted provider needs `path` (a JSON Lines "
                "file of replies, relative to the providers file)",
                provider=config.name,
            )
        self.config = config
        self.path = Path(base_dir) / config.path

    @property
    def name(self) -> str:
        """The configured provider name."""
        return self.config.name

    def check_credentials(self) -> None:
        """A reply file needs no credentials: nothing to check."""

    def build_request_bytes(self, req: ChatRequest) -> bytes:
        """Canonical JSON of ``{"call_index", "messages", "schema_name"}``.

        The schema itself is left out: its name identifies it, and the reply does not
        depend on it.
        """
        return canonical_json(
            {"messages": req.messages, "schema_name": req.schema_name, "call_index": req.call_index}
        )

    def send(self, request_bytes: bytes, req: ChatRequest) -> ProviderReply:
        """Return line ``req.call_index`` of the script.

        Returns:
            ``ProviderReply`` whose ``raw`` is the line's exact bytes (no terminator),
            ``content`` its UTF-8 text, ``http_status`` and token counts ``None``.

        Raises:
            ProviderConfigurationError: ``PROVIDER_SCRIPT_UNREADABLE`` (missing file, not
                UTF-8) or ``PROVIDER_SCRIPT_EXHAUSTED`` (fewer lines than ``call_index + 1``).
        """
        raw: bytes | None = None
        count = 0
        try:  # line call_index, without a list of every line (a file of 20 million)
            data = read_bounded(self.path, MAX_SCRIPT_FILE_BYTES)
            for _, line in iter_script_lines(data, self.path):
                if count == req.call_index:
                    raw = line
                    if len(data) <= MAX_RESPONSE_BYTES:
                        break  # no line of the file can be too large: done
                count += 1  # past it in a larger file: a line too large anywhere is refused
        except OSError as exc:
            raise ProviderConfigurationError(
                PROVIDER_SCRIPT_UNREADABLE,
                f"provider {self.name!r}: cannot read script {self.path}: {exc.strerror or exc}",
                provider=self.name,
                path=str(self.path),
            ) from exc
        if raw is None:
            raise ProviderConfigurationError(
                PROVIDER_SCRIPT_EXHAUSTED,
                f"provider {self.name!r}: script {self.path} has {count} replies and the "
                f"case's model call {req.call_index + 1} needs reply {req.call_index + 1}; "
                "append replies (served lines stay as they are) or configure another provider",
                provider=self.name,
                path=str(self.path),
                call_index=req.call_index,
                lines=count,
            )
        return ProviderReply(content=self.content_from_raw(raw), raw=raw)

    def content_from_raw(self, raw: bytes) -> str:
        """The reply text of a stored line.

        Raises:
            ProviderConfigurationError: ``PROVIDER_SCRIPT_UNREADABLE`` when it is not UTF-8.
        """
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProviderConfigurationError(
                PROVIDER_SCRIPT_UNREADABLE,
                f"provider {self.name!r}: a reply line of {self.path} is not UTF-8 ({exc})",
                provider=self.name,
                path=str(self.path),
            ) from exc
