"""Each dialect's per-turn schemas compiled by the real converters servers use.

* llama.cpp: llama-cpp-python's converter (``json_schema_to_gbnf``, what its server runs
  for ``json_object`` + ``schema``) and llama.cpp's own grammar parser
  (``llama_sampler_init_grammar`` with SmolLM2's vocabulary, which refuses a grammar the
  server would crash on). The uncapped schema is the control: it must fail to compile.
* xgrammar (vLLM's and SGLang's default backend): compiles the ``vllm``/``sglang`` form
  and the OpenAI strict form, and accepts replies drawn from the schema.
(llguidance runs in the main suite: ``tests/unit/test_dialects.py``.)
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from investigation.llm import dialects
from tests.models.conftest import model_path, need
from tests.schema_sampler import sample
from tests.turn_schemas import representative_schemas

pytestmark = pytest.mark.models
SCHEMAS = representative_schemas()


@pytest.fixture(scope="module")
def vocab() -> Any:
    need("llama_cpp")
    import llama_cpp

    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(str(model_path()).encode(), params)
    assert model, "the model file did not load"
    yield llama_cpp.llama_model_get_vocab(model)
    llama_cpp.llama_model_free(model)


def _llama_compiles(vocab: Any, schema: dict[str, Any]) -> bool:
    import llama_cpp
    from llama_cpp import llama_grammar

    grammar = llama_grammar.json_schema_to_gbnf(json.dumps(schema))
    sampler = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
    if not sampler:
        return False
    llama_cpp.llama_sampler_free(sampler)
    return True


@pytest.mark.parametrize("dialect", ["llama_cpp", "ollama"])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_llama_cpp_compiles_the_grammar_dialects(vocab: Any, dialect: str, name: str) -> None:
    fmt = dialects.response_format(dialect, SCHEMAS[name], "investigation_reply")
    assert fmt is not None
    schema = fmt["schema"] if "schema" in fmt else fmt["json_schema"]["schema"]
    assert _llama_compiles(vocab, schema)


_CHILD = """
import json, sys
import llama_cpp
from llama_cpp import llama_grammar
params = llama_cpp.llama_model_default_params()
params.vocab_only = True
model = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), params)
vocab = llama_cpp.llama_model_get_vocab(model)
grammar = llama_grammar.json_schema_to_gbnf(open(sys.argv[2]).read())
sys.exit(0 if llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode(), b"root") else 3)
"""


def _compiles_in_a_child(schema: dict[str, Any], tmp_path: Path) -> int:
    """Compile in a child process (a grammar llama.cpp refuses can crash the process, as it
    crashed the server): 0 compiled, 3 refused, negative a signal."""
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    return subprocess.run([sys.executable, "-c", _CHILD, str(model_path()), str(path)],
                          capture_output=True, timeout=600, check=False).returncode


def test_the_uncapped_schema_is_what_crashed_llama_cpp(tmp_path: Path) -> None:
    # The control: the contract's maxLength 4000 expands past llama.cpp's repetition
    # limit ("exceeds sane defaults"); the parser refuses it or the process dies, as the
    # server did. Capping (the llama_cpp dialect) is why it compiles.
    need("llama_cpp")
    assert _compiles_in_a_child(SCHEMAS["first_turn"], tmp_path) != 0
    assert _compiles_in_a_child(dialects.grammar_friendly(SCHEMAS["first_turn"], 1000),
                                tmp_path) == 0


@pytest.mark.parametrize("dialect", ["vllm", "sglang", "openai"])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_xgrammar_compiles_and_accepts_sampled_replies(dialect: str, name: str) -> None:
    need("xgrammar")
    import xgrammar

    fmt = dialects.response_format(dialect, SCHEMAS[name], "investigation_reply")
    assert fmt is not None
    schema = fmt["json_schema"]["schema"]
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False,
                                                separators=(",", ":"))
    rng = random.Random(f"{dialect}-{name}")
    for _ in range(5):
        reply = sample(SCHEMAS[name], rng)
        if dialect == "openai":
            from tests.unit.test_dialects import _nullify

            reply = _nullify(reply, schema)
        text = json.dumps(reply, separators=(",", ":"), ensure_ascii=False)
        assert xgrammar.testing._is_grammar_accept_string(grammar, text), text
    bad = dict(sample(SCHEMAS[name], rng))
    bad["next"] = {"action": "write_file", "reason": "x"}
    assert not xgrammar.testing._is_grammar_accept_string(
        grammar, json.dumps(bad, separators=(",", ":")))
