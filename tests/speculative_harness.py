"""Drafters for speculative-decoding tests: spoil another drafter's drafts, or draft what the
model will say (read from a run without speculation), so a test chooses how many drafts are
accepted, from none to all, at every draft index."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from pegainfer import LLM
from pegainfer.core.engine.core import EngineCore
from pegainfer.core.engine.messages import EngineRequest
from pegainfer.core.sampling.sampling_params import SamplingParams
from pegainfer.core.speculative.drafter import Drafter, DraftInputs, Drafts
from pegainfer.core.speculative.mtp import MTPDrafter
from tests.engine_harness import make_engine


def spoil(tokens: list[list[int]], positions: list[int], vocab: int) -> list[list[int]]:
    """Replace the drafts whose position plus index is 1 mod 3 by another token: rejections
    then fall on every draft index, and some runs of drafts stay whole."""
    return [[(t + 1) % vocab if (position + i) % 3 == 1 else t for i, t in enumerate(row)]
            for row, position in zip(tokens, positions, strict=True)]  # fmt: skip


class SpoilingDrafter(Drafter):
    """Another drafter's drafts, some replaced (`spoil`)."""

    def __init__(self, inner: Drafter, vocab: int) -> None:
        super().__init__(inner.num_tokens)
        self.inner, self.vocab = inner, vocab

    def propose(self, inputs: DraftInputs) -> Drafts:
        drafts = self.inner.propose(inputs)
        positions = [r.num_tokens - 1 for r in inputs.drafted]
        return Drafts(spoil(drafts.tokens, positions, self.vocab), drafts.probs)


class OracleDrafter(Drafter):
    """Drafts the tokens that follow a request's sequence in `sequences` (by request id: the
    prompt and what greedy decoding without speculation gave), spoiled when `vocab` is set."""

    def __init__(self, num_tokens: int, sequences: dict[str, list[int]], vocab: int = 0) -> None:
        super().__init__(num_tokens)
        self.sequences, self.vocab = sequences, vocab

    def propose(self, inputs: DraftInputs) -> Drafts:
        tokens, positions = [], []
        for request in inputs.drafted:
            known = self.sequences[request.request_id][request.num_tokens :]
            tokens.append((known + [0] * self.num_tokens)[: self.num_tokens])
            positions.append(request.num_tokens - 1)
        return Drafts(spoil(tokens, positions, self.vocab) if self.vocab else tokens)


def run_workload(
    engine: EngineCore, workload: list[tuple[str, list[int], SamplingParams, list[int]]]
) -> dict[str, tuple[list[int], str | None]]:
    """Run `workload` (request id, prompt, parameters, EOS ids) to the end: each request's
    tokens and finish reason; the pool is empty afterwards."""
    for rid, prompt, params, eos in workload:
        engine.add_request(EngineRequest(request_id=rid, prompt_token_ids=prompt, params=params,
                                         eos_token_ids=eos, arrival_time=0.0))  # fmt: skip
    results: dict[str, tuple[list[int], str | None]] = {}
    while engine.has_unfinished_requests:
        for output in engine.step():
            tokens, _ = results.get(output.request_id, ([], None))
            results[output.request_id] = (tokens + output.new_token_ids, output.finish_reason)
    engine.block_manager.check_invariants()
    assert engine.block_manager.usage == 0.0 and not engine.scheduler.running
    return results


def sequences_of(batch: list[list[int]], outputs: list[list[int]]) -> dict[str, list[int]]:
    """Each prompt and its output, by request id (its index): what an oracle drafts."""
    return {str(i): p + o for i, (p, o) in enumerate(zip(batch, outputs, strict=True))}


def check_preemption_and_stops(
    batch: list[list[int]], plain: list[list[int]], max_tokens: int, plain_engine: EngineCore,
    oracle_engine: Callable[[dict[str, list[int]]], EngineCore],
) -> EngineCore:  # fmt: skip
    """Five prompts and plain greedy decoding's outputs of `max_tokens`, run again (on
    engines whose pool is too small for them: preemption) as seven requests, EOS ending the
    fifth at a token inside its output, the same with min_tokens past it, and max_tokens 7
    on the second: the engine `oracle_engine` makes from the sequences to draft gives what
    `plain_engine` gives, and preempts. Returns it."""
    at = next(i for i in range(3, max_tokens) if plain[4][i] not in plain[4][:i])
    stop = plain[4][at]

    def greedy(max_tokens: int, **more) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, **more)

    workload = [(str(i), p, greedy(max_tokens, ignore_eos=True), [])
                for i, p in enumerate(batch[:4])]  # fmt: skip
    workload += [("4", batch[4], greedy(max_tokens), [stop]),
                 ("5", batch[4], greedy(max_tokens, min_tokens=at + 2), [stop]),
                 ("6", batch[1], greedy(7, ignore_eos=True), [])]  # fmt: skip
    expected = run_workload(plain_engine, workload)
    assert expected["4"] == (plain[4][: at + 1], "stop")
    sequences = sequences_of(batch, plain) | {"5": batch[4] + expected["5"][0],
                                              "6": batch[1] + plain[1]}  # fmt: skip
    engine = oracle_engine(sequences)
    assert run_workload(engine, workload) == expected
    assert engine.scheduler.counters.preemptions > 0
    return engine


def chi_square(observed: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of `observed` counts against `expected` ones, the bins expecting
    fewer than 5 pooled into one, and its degrees of freedom."""
    bins = expected >= 5
    chi2 = ((observed[bins] - expected[bins]) ** 2 / expected[bins]).sum()
    rest_observed, rest_expected = observed[~bins].sum(), expected[~bins].sum()
    chi2 += (rest_observed - rest_expected) ** 2 / rest_expected.clamp_min(1e-9)
    return float(chi2), int(bins.sum())


def chi_square_999(df: int) -> float:
    """The chi-square distribution's 0.999 quantile (Wilson and Hilferty's approximation)."""
    z, a = 3.0902, 2.0 / (9.0 * df)
    return df * (1.0 - a + z * a**0.5) ** 3


def check_stop_string_inside_an_accepted_run(checkpoint: Path) -> None:
    """A stop string completed by a token inside a run of accepted drafts (the model drafting
    for itself: every draft accepted) ends the output there: text and token ids equal plain
    decoding's (`checkpoint`: a tiny one with its tokenizer)."""
    common = {"max_model_len": 128, "block_size": 4, "device": "cpu"}
    plain = LLM(str(checkpoint), **common)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    text = plain.generate(["Hello there"], params)[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text
    stopped = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    expected = plain.generate(["Hello there"], stopped)[0]
    assert expected.finish_reason == "stop"
    speculative = LLM(str(checkpoint), **common, speculative_tokens=4, speculative_method="self")
    got = speculative.generate(["Hello there"], stopped)[0]
    assert (got.text, got.token_ids, got.finish_reason) == (
        expected.text,
        expected.token_ids,
        expected.finish_reason,
    )


def random_prompts(seed: int, lengths: tuple[int, ...], *, vocab: int) -> list[list[int]]:
    """Prompts of `lengths` tokens drawn below `vocab`, the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def mtp_oracle_engine(
    path: Path,
    k: int,
    sequences: dict[str, list[int]],
    spoil: bool = True,
    *,
    vocab: int,
    **overrides,
) -> EngineCore:
    """An engine built with its line's MTP drafter, whose drafts are then plain decoding's
    `sequences`, spoiled at some positions (with tokens of `vocab`) unless `spoil` is False."""
    engine = make_engine(path, speculative_tokens=k, **overrides)
    assert isinstance(engine.speculative.drafter, MTPDrafter)
    engine.speculative.drafter = OracleDrafter(k, sequences, vocab if spoil else 0)
    return engine
