"""Speculative decoding on a tiny Qwen3 checkpoint: greedy output with drafts verified equals
greedy output without, token for token, through batches, chunked prefill, prefix hits,
preemption, stops and length limits inside an accepted run, logprobs and penalties. Drafts
come from the model itself (all accepted) and spoiled (variable accepted counts, every
rejection position)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pegainfer import SamplingParams
from pegainfer.core.args import EngineArgs
from pegainfer.core.engine.core import EngineCore
from pegainfer.core.engine.metrics import Metrics
from pegainfer.core.errors import ConfigError
from pegainfer.core.speculative.drafter import Drafter, DraftInputs, Drafts
from pegainfer.models.qwen3.line import Qwen3Line
from tests import engine_harness
from tests.engine_harness import DEFAULTS, check_prefix_hit_equals_cold, generate, greedy
from tests.qwen3.hf_reference import VOCAB, load_hf
from tests.speculative_harness import (
    SpoilingDrafter,
    check_stop_string_inside_an_accepted_run,
    chi_square,
    chi_square_999,
    run_workload,
)


def speculative_engine(path: Path, k: int, spoil: bool = False, **overrides) -> EngineCore:
    engine = engine_harness.make_engine(
        path, speculative_tokens=k, speculative_method="self", **overrides
    )
    if spoil:
        engine.speculative.drafter = SpoilingDrafter(engine.speculative.drafter, VOCAB)
    return engine


def prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def path(hf_checkpoints) -> Path:
    return hf_checkpoints(False)


@pytest.mark.parametrize(("k", "spoil"), [(1, False), (3, False), (2, True), (4, True)])
def test_greedy_batch_equals_plain_decoding(path, k, spoil):
    """Several prompts, some prefilled in chunks beside the others' verify steps."""
    batch = prompts(1, (5, 13, 30, 2, 41))
    expected = generate(engine_harness.make_engine(path, max_num_batched_tokens=24), batch,
                        greedy(23))  # fmt: skip
    engine = speculative_engine(path, k, spoil, max_num_batched_tokens=24)
    assert generate(engine, batch, greedy(23)) == expected
    stats = engine.stats().spec_decode
    assert stats.num_drafts > 0 and stats.num_draft_tokens <= k * stats.num_drafts
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens
    assert stats.accepted_per_pos == sorted(stats.accepted_per_pos, reverse=True)
    if spoil:
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    else:  # the model drafting greedily for itself: every draft is what it verifies
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    engine.block_manager.check_invariants()
    assert engine.block_manager.usage == 0.0


def test_stops_and_limits_inside_an_accepted_run(path):
    """EOS inside a run of accepted drafts ends the request there, max_tokens cuts a run,
    min_tokens holds a stop back within a run (its rows are sampled with the stop banned)."""
    probe = generate(engine_harness.make_engine(path), prompts(2, (9,)), greedy(12))[0]
    # The first token from the fourth on that the output has not had before: EOS ends it there.
    at = next(i for i in range(3, len(probe)) if probe[i] not in probe[:i])
    stop = probe[at]
    batch = prompts(2, (9, 20, 7, 15))
    workload = [
        ("eos", batch[0], SamplingParams(temperature=0.0, max_tokens=30), [stop]),
        ("min", batch[0], SamplingParams(temperature=0.0, max_tokens=30, min_tokens=8), [stop]),
        ("len", batch[1], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), []),
        ("one", batch[2], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), []),
        ("long", batch[3], SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True), []),
    ]
    plain = run_workload(engine_harness.make_engine(path), workload)
    assert plain["eos"] == (probe[: at + 1], "stop") and len(plain["min"][0]) >= 8
    assert plain["len"][1] == "length" and len(plain["len"][0]) == 5
    for k, spoil in ((3, False), (4, True)):
        assert run_workload(speculative_engine(path, k, spoil), workload) == plain


def test_context_limit_inside_an_accepted_run(path):
    """Drafts never run past max_model_len: the request ends by length exactly there."""
    prompt = prompts(3, (50,))
    unbounded = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    expected = generate(engine_harness.make_engine(path, max_model_len=60), prompt, unbounded)
    engine = speculative_engine(path, 4, max_model_len=60)
    assert generate(engine, prompt, unbounded) == expected
    assert len(expected[0]) == 10


def test_prefix_hit(path, monkeypatch):
    """A repeated prompt reuses the blocks of the first one (only accepted tokens were sealed
    into the cache) and continues as cold."""
    prompt = prompts(4, (22,))[0]
    expected = generate(engine_harness.make_engine(path), [prompt], greedy(14))[0]
    monkeypatch.setitem(DEFAULTS, "speculative_tokens", 3)
    monkeypatch.setitem(DEFAULTS, "speculative_method", "self")
    check_prefix_hit_equals_cold(path, prompt, expected)
    # The second prompt is the first's whole sequence: its blocks were sealed from the
    # verified tokens, drafts never among them.
    engine = speculative_engine(path, 3, spoil=True)
    first = generate(engine, [prompt], greedy(14))[0]
    follow_up = prompt + first
    continued = generate(engine, [follow_up], greedy(6))[0]
    cold = generate(engine_harness.make_engine(path, enable_prefix_caching=False), [follow_up],
                    greedy(6))[0]  # fmt: skip
    assert first == expected and continued == cold
    block = engine.config.block_size
    assert engine.scheduler.counters.prefix_hits >= (len(follow_up) - 1) // block * block


def test_preemption(path):
    """A cache too small for the batch preempts requests (their drafts go with their blocks);
    they recompute and the output is unchanged."""
    batch = prompts(5, (18, 25, 11, 30))
    expected = generate(engine_harness.make_engine(path), batch, greedy(30))
    engine = speculative_engine(path, 3, spoil=True, num_kv_blocks=40, max_model_len=128)
    assert generate(engine, batch, greedy(30)) == expected
    assert engine.scheduler.counters.preemptions > 0


def test_logprobs_and_penalties(path):
    """Each accepted token's logprobs (and the prompt's) are those plain decoding reports;
    penalties count the drafts before each row, so penalised greedy output is unchanged too."""
    batch = prompts(6, (12, 19))
    scored = SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)  # fmt: skip
    penalised = SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True,
                               frequency_penalty=1.5, presence_penalty=0.5,
                               repetition_penalty=1.3)  # fmt: skip

    def outputs(engine: EngineCore) -> dict[str, list]:
        for rid, params in (("scored", scored), ("penalised", penalised)):
            engine_harness.submit(engine, rid, batch[rid == "penalised"], params)
        got: dict[str, list] = {"scored": [], "penalised": [], "logprobs": [], "prompt": []}
        while engine.has_unfinished_requests:
            for output in engine.step():
                got[output.request_id] += output.new_token_ids
                got["logprobs"] += output.logprobs or []
                got["prompt"] += output.prompt_logprobs or []
        return got

    plain = outputs(engine_harness.make_engine(path))
    speculative = outputs(speculative_engine(path, 3, spoil=True))
    assert speculative["scored"] == plain["scored"]
    assert speculative["penalised"] == plain["penalised"]
    assert len(speculative["logprobs"]) == 15 and len(speculative["prompt"]) == 11
    pairs = zip(speculative["logprobs"] + speculative["prompt"],
                plain["logprobs"] + plain["prompt"], strict=True)  # fmt: skip
    for ours, theirs in pairs:
        assert ours.token_id == theirs.token_id and ours.rank == theirs.rank
        assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [t for t, _ in ours.top] == [t for t, _ in theirs.top]


def test_seeded_sampling_is_deterministic(path):
    """A seeded sampled request gives the same tokens every run, whatever shares its batch
    (its drafts, acceptance draws and resampling all come from its own generator)."""
    batch = prompts(7, (10, 16))
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    alone = generate(speculative_engine(path, 3), batch[:1], seeded)[0]
    engine = speculative_engine(path, 3, seed=5)
    engine_harness.submit(engine, "other", batch[1], other)
    together = generate(engine, batch[:1], seeded)[0]
    assert alone == together and len(alone) == 20


def test_metrics_report_spec_decode_counters(path):
    engine = speculative_engine(path, 2, spoil=True)
    generate(engine, prompts(8, (9, 14)), greedy(12))
    metrics = Metrics("tiny")
    metrics.record_engine_stats(engine.stats())
    text = metrics.render().decode()
    stats = engine.speculative.counters
    assert f'vllm:spec_decode_num_drafts_total{{model_name="tiny"}} {stats.num_drafts:.1f}' in text
    assert f"vllm:spec_decode_num_draft_tokens_total{{model_name=\"tiny\"}} " \
           f"{stats.num_draft_tokens:.1f}" in text  # fmt: skip
    accepted = 'vllm:spec_decode_num_accepted_tokens_total{model_name="tiny"}'
    assert f"{accepted} {stats.num_accepted_tokens:.1f}" in text
    for position, count in enumerate(stats.accepted_per_pos):
        series = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
        assert f'{series}{{model_name="tiny",position="{position}"}} {count:.1f}' in text


def test_stop_string_inside_an_accepted_run(tmp_path):
    """A stop string completed inside a run of accepted drafts ends the output there."""
    Qwen3Line().write_tiny_checkpoint(tmp_path, seed=3, num_hidden_layers=2)
    check_stop_string_inside_an_accepted_run(tmp_path)


def test_refusals(path):
    with pytest.raises(ConfigError, match="no MTP drafter"):
        engine_harness.make_engine(path, speculative_tokens=2)
    with pytest.raises(ConfigError, match="no MTP drafter"):  # vLLM's form
        engine_harness.make_engine(path, speculative_config='{"method": "qwen3_5_mtp"}')
    for flags, named in (({"tensor_parallel_size": 2}, "--tensor-parallel-size"),
                         ({"kv_offload": True}, "--kv-offload")):  # fmt: skip
        with pytest.raises(ConfigError, match=named):
            EngineArgs(model=str(path), speculative_tokens=2, **flags).validate()
    with pytest.raises(ConfigError, match="speculative_tokens"):
        EngineArgs(model=str(path), speculative_tokens=-1).validate()


class UniformDrafter(Drafter):
    """Drafts drawn uniformly over the vocabulary, with those probabilities: rejection sampling
    keeps a draft d with probability min(1, V p(d)) and redraws the rest from the residual."""

    def __init__(self, num_tokens: int, vocab: int) -> None:
        super().__init__(num_tokens)
        self.vocab = vocab
        self.generator = torch.Generator().manual_seed(0)

    def propose(self, inputs: DraftInputs) -> Drafts:
        count, k = len(inputs.drafted), self.num_tokens
        tokens = torch.randint(0, self.vocab, (count, k), generator=self.generator)
        return Drafts(tokens.tolist(), torch.full((count, k, self.vocab), 1.0 / self.vocab))


def test_sampled_output_follows_the_model(path):
    """Seeded requests at temperature 0.3 whose drafts are uniform noise: where the first token
    is the most common one, the second (drawn by rejection sampling against the drafts) follows
    the model's distribution after it, as transformers computes it (chi-square)."""
    prompt = prompts(9, (6,))[0]
    engine = speculative_engine(path, 2, max_num_seqs=256)
    engine.speculative.drafter = UniformDrafter(2, VOCAB)
    for i in range(1500):
        params = SamplingParams(temperature=0.3, max_tokens=4, ignore_eos=True, seed=i)
        engine_harness.submit(engine, str(i), prompt, params)
    outputs = list(engine_harness.drain(engine).values())
    first = max(range(VOCAB), key=lambda t: sum(o[0] == t for o in outputs))
    second = torch.tensor([o[1] for o in outputs if o[0] == first])
    assert len(second) >= 300
    stats = engine.speculative.counters
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    with torch.inference_mode():
        logits = load_hf(path)(torch.tensor([[*prompt, first]])).logits[0, -1]
    expected = (logits.double() / 0.3).softmax(-1) * len(second)
    observed = torch.bincount(second, minlength=VOCAB).double()
    chi2, df = chi_square(observed, expected)
    assert chi2 < chi_square_999(df), (chi2, df)
