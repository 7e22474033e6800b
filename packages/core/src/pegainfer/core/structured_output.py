"""Structured output: a grammar per request, enforced by token masks in the sampler.

A request names what its output must match (`StructuredOutput`: a JSON schema, a regex, a
Lark or GBNF grammar, or a list of choices); llguidance compiles it against the model's
tokenizer into a matcher that the engine advances with every token the request commits. Each
step, the matchers of the constrained rows write a bitmask of the tokens allowed next, which
the sampler applies to the logits before anything else, so constrained and free rows share
the batch. A constrained request needs its previous token on the host before its next mask,
so the engine brings pending tokens home first under async scheduling.
"""

from __future__ import annotations

import json
from functools import cache, cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import msgspec
import torch

from pegainfer.core.errors import InvalidRequestError

if TYPE_CHECKING:
    import llguidance

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
        """The llguidance grammar; raise `InvalidRequestError` where it cannot be one."""
        import llguidance

        try:
            if self.kind == "json_schema":
                # Compact JSON: a model cannot pad its output with endless whitespace.
                return llguidance.LLMatcher.grammar_from_json_schema(
                    self.spec, defaults={"whitespace_flexible": False}
                )
            grammar = llguidance.grammar_from(self.kind, self.spec)
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"invalid {self.kind}: {exc}", self.kind) from exc
        error = llguidance.LLMatcher.validate_grammar(grammar)
        if error:
            raise InvalidRequestError(f"invalid {self.kind}: {error}", self.kind)
        return grammar


class Grammars:
    """The model's tokenizer as llguidance sees it (built on first use, for each set of EOS
    tokens: a completed grammar allows exactly the request's EOS tokens), and matchers."""

    def __init__(self, tokenizer_dir: Path, vocab_size: int) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self._tokenizers: dict[tuple[int, ...], llguidance.LLTokenizer] = {}

    @cached_property
    def _tokenizer_json(self) -> str:
        return (self.tokenizer_dir / "tokenizer.json").read_text()

    def tokenizer(self, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
        import llguidance

        key = tuple(eos_token_ids)
        if key not in self._tokenizers:
            # No EOS at all (token-id clients may send none): llguidance's guess from the
            # tokenizer stands in; the request then ends by length or its grammar's last token.
            self._tokenizers[key] = llguidance.LLTokenizer(
                self._tokenizer_json, n_vocab=self.vocab_size, eos_token=list(key) or None
            )
        return self._tokenizers[key]

    def matcher(self, output: StructuredOutput, eos_token_ids: list[int]) -> llguidance.LLMatcher:
        import llguidance

        tokenizer = self.tokenizer(eos_token_ids)
        matcher = llguidance.LLMatcher(tokenizer, output.grammar(), log_level=0)
        if not matcher.is_error():
            # Some grammars compile yet fail on their first mask (a schema that is only a
            # reference to itself): refused here rather than failing the request later.
            matcher.compute_logit_bias()
        if matcher.is_error():
            error = matcher.get_error().split("\n", 1)[0]
            raise InvalidRequestError(f"invalid {output.kind}: {error}", output.kind)
        return matcher


@cache
def _mask_executor() -> llguidance.LLExecutor:
    """llguidance's thread pool (80% of the CPUs, up to 32): a batch's masks are computed and
    its sampled tokens consumed in parallel, outside the GIL."""
    import llguidance

    return llguidance.LLExecutor()


def consume_tokens(pairs: list[tuple[llguidance.LLMatcher, int]]) -> None:
    """Advance each matcher by its sampled token, in parallel. A token the grammar forbids
    (it cannot happen: the mask excluded it) leaves the matcher in its error state."""
    if pairs:
        _mask_executor().consume_token_par(pairs)


def mask_logits(logits: torch.Tensor, rows: list[int], matchers: list) -> torch.Tensor:
    """Logits [B, V] with the tokens each matcher forbids at `rows` set to -inf (a copy).

    Called while the step's forward runs on the GPU: the masks are computed on the host in
    parallel and reach the device by non-blocking copies, so the host never waits for the
    forward here."""
    vocab = logits.shape[1]
    words = (vocab + 31) // 32
    pinned = logits.is_cuda
    bitmask = torch.empty(len(rows), words, dtype=torch.int32, pin_memory=pinned)
    _mask_executor().unsafe_compute_mask_ptr(
        [(matcher, i) for i, matcher in enumerate(matchers)], bitmask.data_ptr(), words * 4,
        len(rows),
    )  # fmt: skip
    index = torch.tensor(rows, dtype=torch.int64, pin_memory=pinned)
    if pinned:
        bitmask = bitmask.to(logits.device, non_blocking=True)
        index = index.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab]
    masked = logits.clone()
    masked[index] = masked[index].masked_fill(~allowed, -torch.inf)
    return masked
