"""Control-token spellings are neutralised in text and JSON, whatever else the text holds
(``loop.prompt.neutralize`` and ``neutralize_json`` skip text that holds neither ``<``
nor ``INST]``: each spelling holds one of them)."""

from __future__ import annotations

import json

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
