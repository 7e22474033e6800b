"""Structured output: a grammar per request, enforced by token masks in the sampler.

A request names what its output must match (`StructuredOutput`: a JSON schema, a regex, a
Lark or GBNF grammar, or a list of choices); llguidance compiles it against the model's
tokenizer into a matcher that the engine advances with every token the request commits. Each
step, the matchers of the constrained rows write a bitmask of the tokens allowed next, which
the sampler applies to the logits before anything else, so constrained and free rows share
the batch (`grammar_mask.py`, the step's side). A constrained request needs its previous token
on the host before its next mask, so the engine brings pending tokens home first under async
scheduling. With speculative decoding a request's verify rows are masked by its matcher's
states after each of its drafts, and the matcher then consumes the accepted tokens, one by one
as they are committed.

Where grammars compile: in the engine's process only, on its loop's grammar threads, never on
the step loop's thread (llguidance compiles in native code outside the GIL). The HTTP server
asks the engine for a verdict before it answers a request with a grammar
(`messages.CheckGrammar`), so a grammar that fails against the tokenizer, or on its first mask,
is a 400 before a stream's status line; the engine keeps the compiled grammar for the request
that follows, so each grammar compiles once. The server itself only converts and validates
grammars without the tokenizer (`StructuredOutput.grammar`, `validate`): llguidance imports no
torch (xgrammar does), and compiling in the server too would cost it llguidance's view of the
tokenizer, ~120 MiB for Qwen3's vocabulary per set of EOS tokens.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from functools import cache, cached_property, lru_cache
from typing import TYPE_CHECKING, Literal

import msgspec

from pegainfer.core.errors import InvalidRequestError
from pegainfer.core.process_info import release_freed_memory
from pegainfer.core.sampling.grammar_tokenizer import GrammarVocabulary

if TYPE_CHECKING:
    import llguidance

    from pegainfer.core.text.tokenizer import Tokenizer

Kind = Literal["json_schema", "regex", "grammar", "choice"]


class StructuredOutput(msgspec.Struct, frozen=True, kw_only=True):
    """What a request's output must match. `spec` is the JSON schema's text, the regex, the
    Lark or GBNF grammar, or a JSON list of the allowed strings."""

    kind: Kind
    spec: str

    @classmethod
    def json_schema(cls, schema: dict | bool) -> StructuredOutput:
        return cls(kind="json_schema", spec=json.dumps(schema))

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredOutput:
        return cls(kind="choice", spec=json.dumps(choices))

    def grammar(self) -> str:
        """The llguidance grammar; raise `InvalidRequestError` where it cannot be one (a JSON
        schema's own types and keywords are checked by `validate`, or when it compiles)."""
        return _grammar(self.kind, self.spec)

    def validate(self) -> None:
        """Check the whole grammar without the tokenizer, as vLLM's frontend does with
        llguidance: up to tens of milliseconds for a large schema, remembered per spec."""
        _validate(self.kind, self.spec)


@lru_cache(maxsize=256)
def _grammar(kind: Kind, spec: str) -> str:
    import llguidance

    try:
        if kind == "json_schema":
            # Compact JSON: a model cannot pad its output with endless whitespace.
            return llguidance.LLMatcher.grammar_from_json_schema(
                spec, defaults={"whitespace_flexible": False}
            )
        grammar = llguidance.grammar_from(kind, spec)
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(f"invalid {kind}: {exc}", kind) from exc
    _check(kind, grammar)
    return grammar


@lru_cache(maxsize=256)
def _validate(kind: Kind, spec: str) -> None:
    grammar = _grammar(kind, spec)
    if kind == "json_schema":  # the others were checked when converted
        _check(kind, grammar)


def _check(kind: Kind, grammar: str) -> None:
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidRequestError(f"invalid {kind}: {error}", kind)


class Grammars:
    """The model's tokenizer as llguidance sees it (`grammar_tokenizer.py`; built on first
    use, for each set of EOS tokens: a completed grammar allows exactly the request's EOS
    tokens), and matchers.

    Compiling a grammar against the tokenizer takes tens of milliseconds for a large schema;
    each compiled matcher is kept (the most recent `_COMPILED` of them) and requests get fresh
    copies of it (microseconds), so a grammar compiled ahead of time on another thread, or
    asked for again by a later request, costs the engine's step loop nothing. Safe to call
    from several threads; llguidance compiles outside the GIL."""

    def __init__(self, load_tokenizer: Callable[[], Tokenizer], vocab_size: int) -> None:
        # Called once, on the first grammar: a process that serves none never loads it.
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self._tokenizers: dict[tuple[int, ...], llguidance.LLTokenizer] = {}
        self._compiled: OrderedDict[tuple[str, str, tuple[int, ...]], llguidance.LLMatcher] = (
            OrderedDict()
        )
        self._lock = threading.Lock()

    @cached_property
    def _vocabulary(self) -> GrammarVocabulary:
        return GrammarVocabulary(self._load_tokenizer(), self.vocab_size)

    def tokenizer(self, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
        key = tuple(eos_token_ids)
        with self._lock:
            tokenizer = self._tokenizers.get(key)
            if tokenizer is not None:
                return tokenizer
            tokenizer = self._tokenizers[key] = self._vocabulary.llguidance_tokenizer(list(key))
        # Loading the tokenizer (in the engine's process) to read its tokens' bytes leaves
        # ~100 MB of freed heap behind for Qwen3's vocabulary.
        release_freed_memory()
        return tokenizer

    def matcher(
        self, output: StructuredOutput, eos_token_ids: list[int], *, force_tokens: bool = True
    ) -> llguidance.LLMatcher:
        """A fresh matcher for `output`; raise `InvalidRequestError` if it does not compile.

        `force_tokens`: where the grammar allows exactly one text next, its mask allows only
        that text's first token as the tokenizer writes it (llguidance's forcing: the model
        writes forced text as it would). Off, any token that spells a start of it is allowed,
        as where the grammar allows several texts."""
        key = (output.kind, output.spec, tuple(eos_token_ids), force_tokens)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
        if compiled is None:
            compiled = self._compile(output, eos_token_ids, force_tokens)
            with self._lock:
                self._compiled[key] = compiled
                if len(self._compiled) > _COMPILED:
                    self._compiled.popitem(last=False)
        return compiled.deep_copy()

    def _compile(
        self, output: StructuredOutput, eos_token_ids: list[int], force_tokens: bool
    ) -> llguidance.LLMatcher:
        import llguidance

        tokenizer = self.tokenizer(eos_token_ids)
        grammar = output.grammar() if force_tokens else _without_forcing(output.grammar())
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if not matcher.is_error():
            # Some grammars compile yet fail on their first mask (a schema that is only a
            # reference to itself): refused here rather than failing the request later.
            matcher.compute_logit_bias()
        if matcher.is_error():
            error = matcher.get_error().split("\n", 1)[0]
            if error == "NoExtensionBias":  # llguidance's word for a first mask allowing nothing
                error = "no answer can satisfy it (no token can begin text it accepts)"
            raise InvalidRequestError(f"invalid {output.kind}: {error}", output.kind)
        return matcher


_COMPILED = 128  # compiled grammars kept for later requests
_NO_FORCING = '%llguidance {"no_forcing": true}\n'


def _without_forcing(grammar: str) -> str:
    """`grammar` (Lark, or llguidance's JSON of named grammars) with llguidance's forcing
    off; its options hold for every grammar a Lark grammar's `@name` refers to."""
    if not grammar.lstrip().startswith("{"):
        return _NO_FORCING + grammar
    top = json.loads(grammar)
    first = top["grammars"][0]["name"]
    wrapper = {"name": "no_forcing", "lark_grammar": f"{_NO_FORCING}start: @{first}"}
    return json.dumps(top | {"grammars": [wrapper, *top["grammars"]]})


@cache
def mask_executor() -> llguidance.LLExecutor:
    """llguidance's thread pool (80% of the CPUs, up to 32): a batch's masks are computed and
    its sampled tokens consumed in parallel, outside the GIL."""
    import llguidance

    return llguidance.LLExecutor()


def consume_tokens(pairs: list[tuple[llguidance.LLMatcher, int]]) -> None:
    """Advance each matcher by its sampled token, in parallel. A token the grammar forbids
    (it cannot happen: the mask excluded it) leaves the matcher in its error state."""
    if pairs:
        mask_executor().consume_token_par(pairs)
