"""Control-token spellings are neutralised in text and JSON, whatever else the text holds
(``loop.prompt.neutralize`` and ``neutralize_json`` skip text that holds neither ``<``
nor ``INST]``: each spelling holds one of them)."""

from __future__ import annotations

import json
import random

import pytest

from investigation.loop.prompt import CONTROL_TOKENS, neutralize, neutralize_json


@pytest.mark.parametrize("text, want", [
    ("obey [INST] now", "obey [ INST] now"),  # no '<' anywhere
    ("end [/INST]", "end [ /INST]"),
    ("a <|im_end|> b", "a < |im_end|> b"),
    ("</s> and <start_of_turn>", "< /s> and < start_of_turn>"),
    ("nothing to do here [INS] <", "nothing to do here [INS] <"),
    ("", ""),
])
def test_every_spelling_is_neutralised_in_text(text: str, want: str) -> None:
    assert neutralize(text) == want
    assert CONTROL_TOKENS.search(neutralize(text)) is None


@pytest.mark.parametrize("value", ["obey [INST] now", "[/INST]", "x <|eot_id|> y", "plain"])
def test_json_keeps_its_value_and_loses_every_spelling(value: str) -> None:
    text = json.dumps({"statement": value}, ensure_ascii=False)
    shown = neutralize_json(text)
    assert json.loads(shown) == {"statement": value}
    assert CONTROL_TOKENS.search(shown) is None


def _by_pattern(text: str, first: str) -> str:
    """What the pattern alone gives: the reference the candidate scan must equal."""
    if first == "space":
        return CONTROL_TOKENS.sub(lambda m: m.group(0)[0] + " " + m.group(0)[1:], text)
    return CONTROL_TOKENS.sub(lambda m: f"\\u{ord(m.group(0)[0]):04x}" + m.group(0)[1:], text)


def test_the_candidate_scan_equals_the_pattern_on_random_and_crowded_text() -> None:
    # Only the positions of '<' and of 'INST]' are tried when they are few; overlapping
    # and adjacent spellings ('<<|', '<<SYS>>', '[[INST]') must come out as re.sub's.
    pieces = ["<", "|", "[", "/", "INST", "]", "<<", "SYS", ">>", "s", ">", "start", "end",
              "_of_turn", "x", " ", "<|", "[INST]", "</s>", "é", "\n"]
    rng = random.Random(13)
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))
             for _ in range(20_000)]
    texts += ["<" * 100 + "<|x [INST]", "[INST]" * 70 + "<s>", "a" * 5000 + "<|b"]
    for text in texts:
        assert neutralize(text) == _by_pattern(text, "space"), text
        assert neutralize_json(text) == _by_pattern(text, "escape"), text


@pytest.mark.parametrize("arguments", [
    {"path": "src/app.py", "start_line": 1, "end_line": 40},
    {"b": [1.5, -0.0, 10**30], "a": {"é": "x" * 300}},  # sorted keys, cut at 200
    {"x": float("nan")},  # never stored (the contract refuses it), still shown as before
    {"q": "\ud800"},  # a lone surrogate: likewise
])
def test_a_querys_arguments_show_as_sorted_json(arguments: dict[str, object]) -> None:
    from investigation.loop.prompt import _args

    want = json.dumps(arguments, ensure_ascii=False, sort_keys=True)
    want = want if len(want) <= 200 else want[:200] + "..."
    assert _args(arguments) == want
    assert _args(arguments) == want  # the cached second reading
