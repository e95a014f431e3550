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
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp.llama_grammar import json_schema_to_gbnf

from dynamo_cli.engine import Guided
from dynamo_cli.errors import RequestError

ANY_OBJECT = '{"type": "object"}'

_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
assert _TOKEN_DATA.itemsize == ctypes.sizeof(llama_cpp.llama_token_data)


def gbnf_for(guided: Guided) -> str:
    """The GBNF grammar (root rule `root`) that `guided` asks for."""
    if guided.kind == "json_object":
        schema = ANY_OBJECT
    elif guided.kind == "json_schema":
        schema = guided.schema
    else:
        raise RequestError(f"guided decoding kind '{guided.kind}' is not one of json_object, json_schema",
                           param="response_format")  # fmt: skip
    try:
        return str(json_schema_to_gbnf(schema))
    except RecursionError:
        raise RequestError("the JSON schema nests too deeply for llama.cpp's grammar",
                           param="response_format") from None  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - the converter asserts (AssertionError), or trips on odd input
        raise RequestError(f"llama.cpp cannot turn the JSON schema into a grammar: {exc}",
                           param="response_format") from None  # fmt: skip


class GrammarDeadEnd(Exception):
    """The grammar allows no token here: the request cannot go on."""


class GuidedSampler:
    """A sampler chain behind a grammar: one request's constrained sampling."""

    def __init__(self, vocab: Any, n_vocab: int, grammar: str, chain: Any) -> None:
        self.grammar = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
        if not self.grammar:
            raise RequestError("llama.cpp refused the grammar made from the JSON schema", param="response_format")
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
