"""Structured output with speculative decoding (a tiny Qwen3 with its tokenizer): each verify
row is masked by the request's grammar after the drafts before it, the grammar consumes the
accepted tokens only, one by one as they are committed. Greedy constrained output equals plain
decoding's token for token, whether the drafts are all accepted, accepted in part, or refused
by the grammar; sampled constrained output matches its constraint."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from pegainfer.core.engine.core import EngineCore
from pegainfer.core.sampling.grammar_mask import mask_drafted_logits
from pegainfer.core.sampling.sampling_params import SamplingParams
from pegainfer.core.sampling.structured_output import StructuredOutput
from pegainfer.core.text.tokenizer import Tokenizer
from pegainfer.models.qwen3.line import Qwen3Line
from tests.engine_harness import make_engine
from tests.speculative_harness import OracleDrafter, run_workload

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "size"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "size": {"enum": ["s", "m", "l"]}}}  # fmt: skip
REGEX = r"[a-z]{3}-\d{2}"
CHOICES = ["red", "green", "blue sky"]
OUTPUTS = {"schema": StructuredOutput.json_schema(SCHEMA),
           "regex": StructuredOutput(kind="regex", spec=REGEX),
           "choice": StructuredOutput.choice(CHOICES)}  # fmt: skip
VOCAB = 1000  # the oracle's spoiled drafts are drawn below this


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("speculative-structured")
    Qwen3Line().write_tiny_checkpoint(path, seed=3)
    return path


@pytest.fixture(scope="module")
def eos(model_dir) -> list[int]:
    return [Tokenizer.from_dir(model_dir).token_to_id("<|im_end|>")]


def workload(eos: list[int], temperature: float = 0.0) -> list:
    """Two requests per constraint and two free ones, prompts of a few tokens."""
    jobs = []
    for n, (name, output) in enumerate(OUTPUTS.items()):
        for i in range(2):
            params = SamplingParams(temperature=temperature, seed=n * 2 + i, max_tokens=40,
                                    structured=output)  # fmt: skip
            jobs.append((f"{name}-{i}", [5 + n, 9 + i, 11], params, eos))
    for i in range(2):
        params = SamplingParams(temperature=temperature, seed=10 + i, max_tokens=12)
        jobs.append((f"free-{i}", [7, i], params, eos))
    return jobs


def oracle_engine(
    model_dir, k: int, plain: dict[str, tuple[list[int], str | None]], jobs: list, spoil: bool
) -> EngineCore:
    engine = make_engine(model_dir, speculative_tokens=k, speculative_method="self")
    sequences = {rid: prompt + plain[rid][0] for rid, prompt, _, _ in jobs}
    engine.speculative.drafter = OracleDrafter(k, sequences, VOCAB if spoil else 0)
    return engine


@pytest.mark.parametrize(("k", "drafter"), [(3, "all"), (4, "spoiled"), (2, "self")])
def test_greedy_constrained_output_equals_plain_decoding(model_dir, eos, k, drafter):
    """Drafts of plain decoding's output (every one accepted: each row's mask must be the
    grammar's after the drafts before it), spoiled one in three (accepted in part), or the
    model's own unconstrained argmax (often refused by the grammar)."""
    jobs = workload(eos)
    plain = run_workload(make_engine(model_dir), jobs)
    if drafter == "self":
        engine = make_engine(model_dir, speculative_tokens=k, speculative_method="self")
    else:
        engine = oracle_engine(model_dir, k, plain, jobs, spoil=drafter == "spoiled")
    assert run_workload(engine, jobs) == plain
    stats = engine.speculative.counters
    if drafter == "all":  # all but those past a request's end (a grammar's, or EOS)
        assert stats.num_accepted_tokens > 0.8 * stats.num_draft_tokens
        assert stats.accepted_per_pos[-1] > 0
    else:
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_sampled_constrained_output_matches_its_constraint(model_dir, eos):
    """Sampled requests whose drafts are the model's own samples, drawn without the grammar:
    rejection sampling against the masked distribution keeps every output to its grammar."""
    jobs = [(f"{rid}-{seed}", prompt, SamplingParams(temperature=1.0, seed=seed, max_tokens=40,
                                                     structured=params.structured), eos)
            for seed in range(2) for rid, prompt, params, _ in workload(eos)
            if params.structured is not None]  # fmt: skip
    engine = make_engine(model_dir, speculative_tokens=3, speculative_method="self",
                         max_num_seqs=32)  # fmt: skip
    results = run_workload(engine, jobs)
    tokenizer = Tokenizer.from_dir(model_dir)
    for rid, (tokens, reason) in results.items():
        assert reason == "stop", (rid, reason)
        text = tokenizer.decode(tokens[:-1] if tokens[-1] == eos[0] else tokens)
        if rid.startswith("schema"):
            jsonschema.validate(json.loads(text), SCHEMA)
        elif rid.startswith("regex"):
            assert re.fullmatch(REGEX, text), text
        else:
            assert text in CHOICES, text
    assert engine.speculative.counters.num_accepted_tokens > 0


def test_each_verify_row_is_masked_after_the_drafts_before_it(model_dir):
    """Row j of a request is the matcher's mask after its first j drafts; past a draft the
    grammar refuses, rows are left as they were; the matcher ends where it started."""
    engine = make_engine(model_dir)
    grammars = engine.grammars
    matcher = grammars.matcher(StructuredOutput(kind="regex", spec="ab+c?"), [7])
    tokenize = grammars.tokenizer([7]).tokenize_str
    (a,), (b,), (z,) = tokenize("a"), tokenize("b"), tokenize("z")
    vocab = engine.config.vocab_size
    logits = torch.randn(7, vocab, generator=torch.Generator().manual_seed(0))
    masked = mask_drafted_logits(logits, [(matcher, 1, [a, b, z, b])])

    def allowed(prefix: list[int]) -> list[int]:
        reference = grammars.matcher(StructuredOutput(kind="regex", spec="ab+c?"), [7])
        assert reference.consume_tokens(prefix)
        return [t for t in range(vocab) if reference.validate_tokens([t]) == 1]

    for row, prefix in ((1, []), (2, [a]), (3, [a, b])):
        assert torch.isfinite(masked[row]).nonzero().flatten().tolist() == allowed(prefix)
    assert torch.equal(masked[[0, 4, 5, 6]], logits[[0, 4, 5, 6]])
    assert matcher.validate_tokens([a]) == 1 and matcher.validate_tokens([b]) == 0
