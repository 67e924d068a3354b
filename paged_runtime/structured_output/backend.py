"""Compiles output constraints with xgrammar, once per distinct constraint.

The engine's processor compiles a request's constraint when the request is processed (off the event loop),
so an invalid schema, regex or grammar is a ``ParameterError`` carrying the compiler's own message before any
compute; the model runner later asks for the same key and gets the cached automaton. xgrammar is imported on
first use: a server that never sees a constrained request never pays for it.

JSON is compiled with fixed separators (``", "`` and ``": "``, xgrammar's ``any_whitespace=False``): free
whitespace lets a small model loop on newlines until ``max_tokens``, and vLLM users hit exactly that.
"""
from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from paged_runtime.sampling_params import ParameterError, StructuredOutputsParams

CACHE_SIZE = 256  # distinct compiled constraints kept (LRU)
# xgrammar prefixes its messages with "[time] /path/file.cc:line: ": the client needs only the rest.
_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def constraint_key(params: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, canonical text): equal constraints share one compiled automaton. JSON keeps its keys' order:
    the schema's property order is the order the output writes them in. JSON kinds free to use any
    whitespace are kinds of their own ("json+whitespace")."""
    kind = params.kind
    if kind == "json":
        spec = params.json if isinstance(params.json, str) else json.dumps(params.json)
    elif kind == "choice":
        spec = json.dumps(params.choice)
    else:
        spec = "" if kind == "json_object" else getattr(params, kind)
    if kind.startswith("json") and params.any_whitespace:
        kind += "+whitespace"
    return kind, spec


@dataclass(slots=True)
class CompileStats:
    num_compiled: int = 0
    num_hits: int = 0
    compile_seconds: float = 0.0


class GrammarBackend:
    """xgrammar's compiler for one tokenizer and vocabulary, with an LRU cache of compiled constraints.

    Thread-safe: the tokenizer worker (validation) and the step loop (the runner's matchers) both call it.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.stats = CompileStats()
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler = None

    def __reduce__(self):
        """A worker process gets a fresh backend for the same tokenizer (it compiles, and caches, on its own)."""
        return GrammarBackend, (self.tokenizer, self.vocab_size, self.stop_token_ids)

    def compile(self, params: StructuredOutputsParams, param: str = "structured_outputs"):
        """The compiled constraint (cached); ``ParameterError`` naming ``param`` with the compiler's message."""
        key = constraint_key(params)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self.stats.num_hits += 1
                return compiled
        start = time.perf_counter()
        try:
            compiled = self._compile(*key)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own InvalidJSONError
            message = _LOCATION.sub("", str(e).strip())
            raise ParameterError(f"invalid {key[0]} constraint: {message}", param) from None
        with self._lock:
            self.stats.num_compiled += 1
            self.stats.compile_seconds += time.perf_counter() - start
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, compiled):
        import xgrammar as xgr
        return xgr.GrammarMatcher(compiled)

    def _compile(self, kind: str, spec: str):
        compiler = self._get_compiler()
        kind, _, whitespace = kind.partition("+")
        if kind == "json":
            json.loads(spec)  # a clear message for text that is not JSON at all
            return compiler.compile_json_schema(spec, any_whitespace=bool(whitespace))
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=bool(whitespace))
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "choice":
            return compiler.compile_grammar("root ::= " + " | ".join(_ebnf_string(c) for c in json.loads(spec)))
        return compiler.compile_grammar(spec)

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            return self._compiler


def _ebnf_string(text: str) -> str:
    """``text`` as an EBNF string literal (JSON escapes are what xgrammar's parser reads)."""
    return json.dumps(text, ensure_ascii=False)
