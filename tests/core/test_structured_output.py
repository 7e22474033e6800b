"""Structured output in the engine: a tiny random model's constrained answers always match
their schema, regex, grammar or choices, batched among free-form requests, under both
schedulers; the sampler's mask is exactly the matcher's."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import pytest
import torch

from pegainfer.core.engine.messages import EngineRequest
from pegainfer.core.errors import InvalidRequestError
from pegainfer.core.sampling.grammar_mask import mask_logits
from pegainfer.core.sampling.sampling_params import SamplingParams
from pegainfer.core.sampling.structured_output import StructuredOutput
from pegainfer.core.text.tokenizer import Tokenizer
from pegainfer.models.qwen3.line import Qwen3Line
from tests.engine_harness import (
    both_schedulers,  # noqa: F401 (a fixture)
    drain,
    make_engine,
)

SCHEMAS = {
    "flat": {"type": "object", "additionalProperties": False,
             "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"},
                            "size": {"enum": ["s", "m", "l"]}},
             "required": ["name", "ok", "size"]},
    "nested": {"type": "object", "additionalProperties": False, "required": ["point", "tags"],
               "properties": {"point": {"type": "object", "additionalProperties": False,
                                        "properties": {"x": {"enum": [0, 1, 2]},
                                                       "y": {"enum": [-1, 1]}},
                                        "required": ["x", "y"]},
                              "tags": {"type": "array", "maxItems": 3,
                                       "items": {"type": "string", "maxLength": 4}}}},
    "array": {"type": "array", "minItems": 1, "maxItems": 4,
              "items": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}},
}  # fmt: skip
REGEX = r"[a-z]{3}-\d{2}"
CHOICES = ["red", "green", "blue sky"]
GRAMMAR = 'root ::= "(" item ("," item)? ")"\nitem ::= "a" | "bb"'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("structured")
    Qwen3Line().write_tiny_checkpoint(path, seed=3)
    return path


def constrained(output: StructuredOutput, seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=150, structured=output)


@pytest.mark.usefixtures("both_schedulers")
def test_answers_match_their_constraints_among_free_requests(model_dir):
    """20 requests per JSON schema, 5 each for a regex, choices and a grammar, and 10
    free-form requests, all in the engine at once."""
    engine = make_engine(model_dir, max_num_seqs=32)
    tokenizer = Tokenizer.from_dir(model_dir)
    eos = [tokenizer.token_to_id("<|im_end|>")]
    jobs: dict[str, tuple[str, object]] = {}
    outputs = {f"schema-{name}-{i}": (StructuredOutput.json_schema(schema), name)
               for name, schema in SCHEMAS.items() for i in range(20)}  # fmt: skip
    outputs |= {f"regex-{i}": (StructuredOutput(kind="regex", spec=REGEX), None) for i in range(5)}
    outputs |= {f"choice-{i}": (StructuredOutput.choice(CHOICES), None) for i in range(5)}
    outputs |= {f"grammar-{i}": (StructuredOutput(kind="grammar", spec=GRAMMAR), None)
                for i in range(5)}  # fmt: skip
    for n, (rid, (output, schema)) in enumerate(outputs.items()):
        jobs[rid] = (output.kind, schema)
        params = constrained(output, seed=n)
        engine.add_request(EngineRequest(request_id=rid, prompt_token_ids=[5 + n % 7, 9, 11],
                                         params=params, eos_token_ids=eos,
                                         arrival_time=0.0))  # fmt: skip
    for i in range(10):
        free = SamplingParams(temperature=1.0, seed=100 + i, max_tokens=40)
        engine.add_request(EngineRequest(request_id=f"free-{i}", prompt_token_ids=[7, i],
                                         params=free, eos_token_ids=eos,
                                         arrival_time=0.0))  # fmt: skip
    tokens = drain(engine)
    assert len(tokens) == len(jobs) + 10
    for rid, (kind, schema) in jobs.items():
        # The answer ends where its grammar does: by EOS, or with the last token it allows.
        ids = tokens[rid][:-1] if tokens[rid][-1] == eos[0] else tokens[rid]
        text = tokenizer.decode(ids)
        if kind == "json_schema":
            jsonschema.validate(json.loads(text), SCHEMAS[schema])
        elif kind == "regex":
            assert re.fullmatch(REGEX, text), text
        elif kind == "choice":
            assert text in CHOICES
        else:
            assert re.fullmatch(r"\((a|bb)(,(a|bb))?\)", text), text


def test_the_mask_is_the_matchers(model_dir):
    """Exactly the tokens the matcher accepts keep their logits, row by row; other rows are
    untouched."""
    engine = make_engine(model_dir)
    eos = [7]
    matcher = engine.grammars.matcher(StructuredOutput(kind="regex", spec="ab+c?"), eos)
    matcher.consume_tokens(engine.grammars.tokenizer(eos).tokenize_str("a"))
    vocab = engine.config.vocab_size
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    masked = mask_logits(logits, [1], [matcher])
    allowed = [t for t in range(vocab) if matcher.validate_tokens([t]) == 1]
    assert allowed and torch.isfinite(masked[1]).nonzero().flatten().tolist() == allowed
    assert torch.equal(masked[1, allowed], logits[1, allowed])
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])


def test_bad_constraints_and_combinations_are_refused(model_dir):
    engine = make_engine(model_dir)
    with pytest.raises(InvalidRequestError, match="regex"):
        StructuredOutput(kind="regex", spec="[a-").grammar()
    with pytest.raises(InvalidRequestError, match="nonsense"):
        engine.grammars.matcher(StructuredOutput.json_schema({"type": "nonsense"}), [7])
    for field in ("ignore_eos", "min_tokens"):
        params = SamplingParams(structured=StructuredOutput.choice(["a"]), **{field: 1})
        with pytest.raises(InvalidRequestError, match=field):
            params.validate()


def test_llguidance_reads_our_tokenizer_as_we_do(model_dir):
    """The grammar engine and our tokenizer agree on what every token spells."""
    engine = make_engine(model_dir)
    ours = Tokenizer.from_dir(model_dir)
    theirs: llguidance.LLTokenizer = engine.grammars.tokenizer([7])
    text = 'A {"json": [1, 2.5, "ü→"]} text'
    ids = ours.encode(text)
    assert theirs.decode_str(ids) == text == ours.decode(ids)


@pytest.mark.parametrize(
    "output",
    [
        StructuredOutput(kind="regex", spec="(a{1000}){1000}"),
        StructuredOutput.json_schema(
            {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
        ),
    ],
    ids=["regex-too-large", "recursive-required"],
)
def test_a_grammar_that_fails_mid_generation_ends_the_request_with_an_error(model_dir, output):
    """It ended with finish_reason "stop" and text that broke the constraint, and no log."""
    engine = make_engine(model_dir)
    engine.add_request(EngineRequest(request_id="r", prompt_token_ids=[5, 9, 11],
                                     params=constrained(output, seed=1), eos_token_ids=[7],
                                     arrival_time=0.0))  # fmt: skip
    reasons = []
    while engine.has_unfinished_requests:
        reasons += [o.finish_reason for o in engine.step() if o.finish_reason is not None]
    assert reasons == ["error"]


def test_a_grammar_that_fails_on_its_first_mask_is_refused_up_front(model_dir):
    engine = make_engine(model_dir)
    with pytest.raises(InvalidRequestError, match="json_schema"):
        engine.grammars.matcher(StructuredOutput.json_schema({"$ref": "#"}), [7])


# Qwen's added tokens that are not special (`<think>`, `<tool_call>` ...) are text to a grammar;
# the special ones (`<|im_end|>`) are not. llguidance's own reading of tokenizer.json counted
# both special, so a grammar forcing `<think>` offered its token and then refused it: the
# request failed after one token.
TAGGED = {
    "regex": StructuredOutput(kind="regex", spec=r"<think>[a-z]{1,8}</think>\n?[a-z]{1,4}"),
    "json_schema": StructuredOutput.json_schema({
        "type": "object", "additionalProperties": False, "required": ["call", "end"],
        "properties": {"call": {"const": "<tool_call>x</tool_call>"},
                       "end": {"enum": ["<|im_end|>", "<think>"]}}}),
    "grammar": StructuredOutput(kind="grammar",
                                spec='start: "<think>" /[a-z]{1,6}/ "</think>" <|im_end|>'),
}  # fmt: skip


def test_a_grammar_forcing_an_added_tokens_text_offers_the_token_and_accepts_it(model_dir):
    engine = make_engine(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    think = tokenizer.token_to_id("<think>")
    eos = [tokenizer.token_to_id("<|im_end|>")]
    matcher = engine.grammars.matcher(StructuredOutput(kind="regex", spec="<think>x"), eos)
    # The forced text's canonical first token is the added token: the only one allowed.
    assert allowed_tokens(matcher, engine.config.vocab_size) == [think]
    assert matcher.consume_token(think) and not matcher.is_error()
    assert matcher.consume_tokens(tokenizer.encode("x", add_special_tokens=False))
    assert matcher.is_accepting()
    # The same text in pieces matches too: the token is text to the grammar.
    pieces = tokenizer.encode("<", add_special_tokens=False) + tokenizer.encode(
        "think>x", add_special_tokens=False
    )
    fresh = engine.grammars.matcher(StructuredOutput(kind="regex", spec="<think>x"), eos)
    assert think not in pieces and fresh.validate_tokens(pieces) == len(pieces)


def test_a_special_tokens_text_in_a_grammar_is_text_not_the_token(model_dir):
    """`<|im_end|>` written in a regex is its characters: the forced tokens spell it, the
    special token itself is refused; a Lark grammar names the token as `<|im_end|>`."""
    engine = make_engine(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    im_end = tokenizer.token_to_id("<|im_end|>")
    text = StructuredOutput(kind="regex", spec=r"a<\|im_end\|>")
    matcher = engine.grammars.matcher(text, [im_end])
    tokens = walk_forced(matcher, engine.config.vocab_size)
    assert im_end not in tokens and tokenizer.decode(tokens) == "a<|im_end|>"
    refused = engine.grammars.matcher(text, [im_end])
    assert refused.validate_tokens([*tokenizer.encode("a", add_special_tokens=False), im_end]) == 1
    named = engine.grammars.matcher(StructuredOutput(kind="grammar", spec="start: <|im_end|>"),
                                    [im_end])  # fmt: skip
    assert allowed_tokens(named, engine.config.vocab_size) == [im_end]


def test_a_lark_grammar_naming_a_non_special_added_token_is_refused_clearly(model_dir):
    engine = make_engine(model_dir)
    with pytest.raises(InvalidRequestError, match='unknown special token: "<think>"'):
        engine.grammars.matcher(StructuredOutput(kind="grammar", spec="start: <think>"), [7])


@pytest.mark.parametrize("kind", list(TAGGED))
def test_answers_holding_added_tokens_text_finish_and_match(model_dir, kind):
    """Sampled answers (several seeds, batched) end with "stop", never "error", and decode
    to text their constraint accepts."""
    engine = make_engine(model_dir, max_num_seqs=8)
    tokenizer = Tokenizer.from_dir(model_dir)
    eos = [tokenizer.token_to_id("<|im_end|>")]
    output = TAGGED[kind]
    for seed in range(6):
        engine.add_request(EngineRequest(request_id=str(seed), prompt_token_ids=[5, 9, seed],
                                         params=constrained(output, seed), eos_token_ids=eos,
                                         arrival_time=0.0))  # fmt: skip
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
    assert set(reasons.values()) == {"stop"}, reasons
    for ids in tokens.values():
        text = tokenizer.decode(ids, skip_special_tokens=False)
        if kind == "regex":
            assert re.fullmatch(r"<think>[a-z]{1,8}</think>\n?[a-z]{1,4}(<\|im_end\|>)?", text)
        elif kind == "json_schema":
            answer = json.loads(text.removesuffix("<|im_end|>"))
            assert answer["call"] == "<tool_call>x</tool_call>", text
            assert answer["end"] in ("<|im_end|>", "<think>"), text
        else:
            assert re.fullmatch(r"<think>[a-z]{1,6}</think><\|im_end\|>", text), text


def allowed_tokens(matcher: llguidance.LLMatcher, vocab: int) -> list[int]:
    logits = torch.zeros(1, vocab)
    return torch.isfinite(mask_logits(logits, [0], [matcher])[0]).nonzero().flatten().tolist()


def walk_forced(matcher: llguidance.LLMatcher, vocab: int, limit: int = 64) -> list[int]:
    """The tokens a grammar with one answer forces, each the lowest allowed, to its end."""
    tokens: list[int] = []
    while not matcher.is_stopped() and len(tokens) < limit:
        token = allowed_tokens(matcher, vocab)[0]
        assert matcher.consume_token(token), matcher.get_error()
        tokens.append(token)
    return tokens


def run_one(engine, params: SamplingParams, eos: list[int]) -> tuple[list[int], str, str | None]:
    """One request's output tokens, finish reason and error."""
    engine.add_request(EngineRequest(request_id="one", prompt_token_ids=[5, 9, 11], params=params,
                                     eos_token_ids=eos, arrival_time=0.0))  # fmt: skip
    tokens, reason, error = [], None, None
    while engine.has_unfinished_requests:
        for out in engine.step():
            tokens += out.new_token_ids
            reason, error = out.finish_reason or reason, out.error or error
    return tokens, reason, error


def test_forced_text_is_written_in_other_tokens_where_the_request_bans_its_own(model_dir):
    """A grammar forces its text's canonical tokens; a request that bans those (bad_words,
    allowed_token_ids) got a 500 after its first token. Such a request may write the text in
    any tokens: only a ban that leaves none ends it, with an error that says so."""
    engine = make_engine(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    eos = [tokenizer.token_to_id("<|im_end|>")]
    text = "hello world"
    canonical = tokenizer.encode(text, add_special_tokens=False)
    output = StructuredOutput.choice([text])
    bans = [[t] for t in canonical if len(tokenizer.decode([t])) > 1]
    assert bans  # the canonical tokens are not all single characters
    params = SamplingParams(temperature=0.0, max_tokens=30, structured=output,
                            bad_words_token_ids=bans)  # fmt: skip
    tokens, reason, _ = run_one(engine, params, eos)
    assert reason == "stop" and tokenizer.decode(tokens) == text
    assert not {t for [t] in bans} & set(tokens)

    letters = [tokenizer.token_to_id(c) for c in "helowrd"] + [tokenizer.token_to_id("Ġ"), *eos]
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=30, structured=output,
                            allowed_token_ids=letters)  # fmt: skip
    tokens, reason, _ = run_one(engine, params, eos)
    assert reason == "stop" and tokenizer.decode(tokens) == text and set(tokens) <= set(letters)

    params = SamplingParams(temperature=1.0, seed=1, max_tokens=30, structured=output,
                            allowed_token_ids=letters[1:])  # no "h"  # fmt: skip
    tokens, reason, error = run_one(engine, params, eos)
    assert reason == "error" and "allowed_token_ids or bad_words may leave no token" in error
