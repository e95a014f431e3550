"""A request's `Guided` constraint as a llama.cpp grammar (GBNF), and the sampler that applies it safely.

JSON schemas go through llama-cpp-python's `json_schema_to_gbnf` (the port of llama.cpp's own
converter); `json_object` is the schema `{"type": "object"}`, whose whitespace is bounded, so a small
model cannot wander into endless blank space. A schema the converter cannot take is the request's
error (400), never the worker's.

NOTE: llama.cpp aborts the process (an uncaught C++ exception) when a grammar is told to accept a token
it does not allow, which happens when a grammar allows no token at all (a schema asking for a NUL
character, say) and the sampler picks one anyway. So the grammar is not a link of the sampler chain:
`GuidedSampler.sample` checks the token the chain picks against it, masks the logits with it when it
refuses that token (checking that some token survives), and only then accepts the token. A dead end
fails that request alone.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Iterator
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp.llama_grammar import json_schema_to_gbnf

from dynamo_cli.errors import RequestError
from dynamo_cli.wire import Guided

ANY_OBJECT = '{"type": "object"}'
_LOOSE_CHAR = r'char ::= [^"\\] |'
_JSON_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] |'
"""The Python converter's string character admits raw control characters, which JSON forbids (llama.cpp's
C++ converter excludes them): a newline inside a string would make the output unparseable."""

_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
assert _TOKEN_DATA.itemsize == ctypes.sizeof(llama_cpp.llama_token_data)


def gbnf_for(guided: Guided) -> str:
    """The GBNF grammar (root rule `root`) that `guided` asks for."""
    param = guided.param
    if guided.kind == "json_object":
        schema = ANY_OBJECT
    elif guided.kind == "json_schema":
        schema = guided.schema
    else:
        raise RequestError(f"{param}: guided decoding kind '{guided.kind}' is not json_object or json_schema", param)
    _refuse_unenforced(schema, param)
    try:
        gbnf = str(json_schema_to_gbnf(schema))
    except RecursionError:
        raise RequestError(f"{param}: the JSON schema nests too deeply for llama.cpp's grammar", param) from None
    except Exception as exc:  # noqa: BLE001 - the converter asserts (AssertionError), or trips on odd input
        raise RequestError(f"{param}: llama.cpp cannot turn the JSON schema into a grammar: {exc}", param) from None
    return gbnf.replace(_LOOSE_CHAR, _JSON_CHAR, 1)


UNENFORCED = frozenset(
    {
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "minProperties",
        "maxProperties",
        "patternProperties",
        "propertyNames",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "if",
        "then",
        "else",
        "not",
        "unevaluatedProperties",
        "unevaluatedItems",
    }
)
"""Keywords the converter would silently drop: a schema using one is refused rather than half enforced."""
_SHAPING = frozenset(
    {
        "properties",
        "items",
        "prefixItems",
        "enum",
        "const",
        "pattern",
        "minLength",
        "maxLength",
        "minItems",
        "maxItems",
        "required",
        "additionalProperties",
    }
)
"""Keywords the converter ignores beside a union (`anyOf`, `oneOf`, a list of types) or beside `pattern`."""


def _refuse_unenforced(schema_text: str, param: str) -> None:
    """RequestError naming `param` and the first keyword of the schema llama.cpp's grammar would not enforce."""
    try:
        schema = json.loads(schema_text)
    except ValueError:
        raise RequestError(f"{param}: the JSON schema is not JSON", param) from None
    for path, keyword in _unenforced(schema, "#"):
        raise RequestError(
            f"{param}: llama.cpp's grammar cannot enforce '{keyword}' (at {path}) of the JSON "
            "schema; remove it, or serve with an engine that can (vllm)",
            param,
        )


def _unenforced(schema: Any, path: str) -> Iterator[tuple[str, str]]:
    if not isinstance(schema, dict):
        return
    for keyword in schema:
        if keyword in UNENFORCED:
            yield path, keyword
    union = "anyOf" in schema or "oneOf" in schema or isinstance(schema.get("type"), list)
    if union or "pattern" in schema:
        beside = sorted(k for k in _SHAPING & schema.keys() if k != "pattern")
        if beside:
            yield path, f"{beside[0]} beside {'a union' if union else 'pattern'}"
    for keyword in ("properties", "$defs", "definitions"):
        for name, sub in (schema.get(keyword) or {}).items():
            yield from _unenforced(sub, f"{path}/{keyword}/{name}")
    for keyword in ("items", "prefixItems", "anyOf", "oneOf", "allOf", "additionalProperties"):
        sub = schema.get(keyword)
        for i, item in enumerate(sub if isinstance(sub, list) else [sub]):
            yield from _unenforced(item, f"{path}/{keyword}" + (f"/{i}" if isinstance(sub, list) else ""))


class GrammarDeadEnd(Exception):
    """The grammar allows no token here: the request cannot go on."""


class GuidedSampler:
    """A sampler chain behind a grammar: one request's constrained sampling."""

    def __init__(self, vocab: Any, n_vocab: int, grammar: str, chain: Any, param: str = "response_format") -> None:
        self.grammar = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
        if not self.grammar:
            raise RequestError(f"{param}: llama.cpp refused the grammar made from the JSON schema", param)
        self.chain = chain
        self._data = np.empty(n_vocab, dtype=_TOKEN_DATA)
        self._ids = np.arange(n_vocab, dtype=np.int32)
        self._one = np.empty(1, dtype=_TOKEN_DATA)

    def sample(self, ctx: Any, index: int) -> int:
        """The token for the logits of batch row `index`, allowed by the grammar and accepted by it.

        As llama.cpp's own common sampler: the chain picks from the full logits first and the grammar
        checks only that token, which it mostly allows; only when it does not are the logits masked by
        the grammar (a pass over the whole vocabulary) and the pick repeated. Both ways sample the
        distribution restricted to the allowed tokens."""
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, index), shape=(len(self._data),))
        token = self._pick(logits, masked=False)
        if not self._allows(token):
            token = self._pick(logits, masked=True)
        llama_cpp.llama_sampler_accept(self.grammar, token)
        llama_cpp.llama_sampler_accept(self.chain, token)
        return token

    def _pick(self, logits: np.ndarray[Any, Any], *, masked: bool) -> int:
        data = self._data
        data["id"], data["logit"], data["p"] = self._ids, logits, 0.0
        array = self._array(data)
        if masked:
            llama_cpp.llama_sampler_apply(self.grammar, ctypes.byref(array))
            if not np.isfinite(data["logit"]).any():
                raise GrammarDeadEnd("the JSON schema's grammar allows no token here (no token can produce it)")
        llama_cpp.llama_sampler_apply(self.chain, ctypes.byref(array))
        return int(array.data[array.selected].id)

    def _allows(self, token: int) -> bool:
        one = self._one
        one["id"], one["logit"], one["p"] = token, 0.0, 0.0
        llama_cpp.llama_sampler_apply(self.grammar, ctypes.byref(self._array(one)))
        return bool(np.isfinite(one["logit"][0]))

    def replay(self, token_ids: list[int]) -> None:
        """Advance the grammar over tokens generated elsewhere (migration, remote prefill); GrammarDeadEnd
        for one it does not allow."""
        for token in token_ids:
            if not self._allows(token):
                raise GrammarDeadEnd(f"token {token} of the output so far does not fit the JSON schema")
            llama_cpp.llama_sampler_accept(self.grammar, token)

    def free(self) -> None:
        llama_cpp.llama_sampler_free(self.grammar)
        llama_cpp.llama_sampler_free(self.chain)

    @staticmethod
    def _array(data: np.ndarray[Any, Any]) -> Any:
        pointer = data.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data))
        return llama_cpp.llama_token_data_array(pointer, len(data), -1, False)
