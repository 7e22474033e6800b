"""The reference sampler: filters, seeds, greedy rows, banned tokens."""

from __future__ import annotations

import pytest
import torch

from pegainfer.core.sampling.sampler import SamplingBatch, filtered_probs, sample

V = 8


def make_batch(
    rows: int,
    *,
    temperature=1.0,
    top_k=V,
    top_p=1.0,
    min_p=0.0,
    seeds=None,
    banned=None,
    biases=None,
):
    def col(value, dtype):
        values = value if isinstance(value, list) else [value] * rows
        return torch.tensor(values, dtype=dtype)

    seeds = seeds or [None] * rows
    shared = torch.Generator().manual_seed(1234)
    return SamplingBatch(
        temperature=col(temperature, torch.float32),
        top_k=col(top_k, torch.int64),
        top_p=col(top_p, torch.float32),
        min_p=col(min_p, torch.float32),
        generators=[shared if s is None else torch.Generator().manual_seed(s) for s in seeds],
        banned=banned or [frozenset()] * rows,
        biases=biases or [{}] * rows,
    )


LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0]])


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(0))
    batch = make_batch(5, temperature=[0.0, 0.0, 1.0, 0.0, 1.0], top_k=1)
    assert torch.equal(sample(logits, batch), logits.argmax(-1))


def test_top_k_keeps_k_tokens():
    probs = filtered_probs(LOGITS, make_batch(1, top_k=3))
    assert (probs[0, 3:] == 0).all() and (probs[0, :3] > 0).all()


def test_top_p_keeps_the_smallest_head_reaching_p():
    full = LOGITS.softmax(-1)[0]
    head2 = full[:2].sum().item()
    probs = filtered_probs(LOGITS, make_batch(1, top_p=head2 - 1e-3))
    assert (probs[0, :2] > 0).all() and (probs[0, 2:] == 0).all()
    probs = filtered_probs(LOGITS, make_batch(1, top_p=head2 + 1e-3))
    assert (probs[0, :3] > 0).all() and (probs[0, 3:] == 0).all()
    # The most likely token survives any top_p.
    assert filtered_probs(LOGITS, make_batch(1, top_p=1e-6))[0, 0] > 0


def test_min_p_is_relative_to_the_top_token():
    full = LOGITS.softmax(-1)[0]
    ratio = (full[2] / full[0]).item()
    probs = filtered_probs(LOGITS, make_batch(1, min_p=ratio + 1e-3))
    assert (probs[0, :2] > 0).all() and (probs[0, 2:] == 0).all()


def test_temperature_scales_before_filtering():
    hot = filtered_probs(LOGITS, make_batch(1, temperature=2.0))
    expected = (LOGITS / 2.0).softmax(-1)
    torch.testing.assert_close(hot / hot.sum(), expected)


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.7),
        dict(temperature=1.3, top_k=4),
        dict(top_p=0.8),
        dict(min_p=0.1, temperature=0.9),
        dict(top_k=5, top_p=0.9, min_p=0.05),
    ],
)
def test_sampled_frequencies_match_the_filtered_distribution(params):
    n = 20_000
    logits = LOGITS.expand(n, V).clone()
    tokens = sample(logits, make_batch(n, **params))
    freq = torch.bincount(tokens, minlength=V).float() / n
    expected = filtered_probs(LOGITS, make_batch(1, **params))[0]
    expected = expected / expected.sum()
    assert (freq[expected == 0] == 0).all()
    # Binomial standard error is at most 0.0036 at n=20k; allow ~4 sigma.
    assert (freq - expected).abs().max() < 0.015


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(3))
    alone = sample(logits[2:3], make_batch(1, seeds=[42])).item()
    together = sample(logits, make_batch(6, seeds=[None, 7, 42, None, 9, None]))
    assert together[2].item() == alone
    # The same seed gives the same sequence of draws.
    draws = [
        [sample(logits[:1], b).item() for _ in range(20)]
        for b in (make_batch(1, seeds=[5]), make_batch(1, seeds=[5]))
    ]
    assert draws[0] == draws[1]


def test_banned_tokens_are_never_picked():
    logits = torch.zeros(2000, V)
    logits[:, 0] = 5.0
    banned = [frozenset({0, 3})] * 2000
    tokens = sample(logits, make_batch(2000, banned=banned))
    assert not torch.isin(tokens, torch.tensor([0, 3])).any()
    greedy = sample(logits[:1], make_batch(1, temperature=0.0, banned=[frozenset({0})]))
    assert greedy.item() != 0


def test_logit_bias_is_added_before_everything_else():
    """Greedy rows follow the biased argmax; sampled rows follow softmax(logits + bias), as a
    torch reference computes it; the caller's logits are left as they were."""
    bias = {0: -100.0, 5: 3.0}
    logits = LOGITS.clone()
    greedy = sample(logits, make_batch(1, temperature=0.0, biases=[bias]))
    assert greedy.item() == 5 and torch.equal(logits, LOGITS)
    n = 20_000
    tokens = sample(LOGITS.expand(n, V).clone(), make_batch(n, biases=[bias] * n))
    freq = torch.bincount(tokens, minlength=V).float() / n
    biased = LOGITS[0].clone()
    biased[0] -= 100.0
    biased[5] += 3.0
    assert (freq - biased.softmax(-1)).abs().max() < 0.015


def test_penalties_match_a_reference_computation():
    """Repetition on every token seen (prompt and output), then frequency and presence on the
    output's counts — computed here element by element."""
    from pegainfer.core.sampling.sampler import Penalties

    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -0.2, 1.0, 0.0, -2.0])
    prompt, output = [1, 2], [3, 3, 4, 1]
    penalties = Penalties(0.4, 0.3, 1.5, prompt, output)
    ours = logits.clone()
    penalties.apply(ours)
    expected = logits.clone()
    for token in range(V):
        value = expected[token].item()
        if token in prompt + output:
            value = value / 1.5 if value > 0 else value * 1.5
        count = output.count(token)
        expected[token] = value - 0.3 * count - 0.4 * (count > 0)
    assert torch.allclose(ours, expected)
    batch = make_batch(1, temperature=0.0)
    batch.penalties = [penalties]
    assert sample(logits[None].clone(), batch).item() == int(expected.argmax())


def test_allowed_token_ids_are_the_only_picks():
    logits = torch.zeros(2000, V)
    logits[:, 0] = 5.0
    batch = make_batch(2000)
    batch.allowed = [[2, 6]] * 2000
    assert set(sample(logits, batch).tolist()) == {2, 6}
    greedy = make_batch(2, temperature=0.0)
    greedy.allowed = [[4, 7], None]  # the best allowed one; an unrestricted row is untouched
    assert sample(LOGITS.expand(2, V).clone(), greedy).tolist() == [4, 0]


def test_bad_words_ban_their_last_token_after_the_rest():
    from pegainfer.core.engine.messages import EngineRequest
    from pegainfer.core.engine.request import Request
    from pegainfer.core.sampling.sampling_params import SamplingParams

    params = SamplingParams(bad_words_token_ids=[[5], [1, 2, 3]])
    msg = EngineRequest(request_id="r", prompt_token_ids=[1, 2], params=params,
                        eos_token_ids=[7], arrival_time=0.0)  # fmt: skip
    request = Request(msg, max_tokens=10, generator=None)
    assert request.banned_token_ids() == {5}  # the prompt's 1, 2 do not count
    request.token_ids += [1, 2]
    assert request.banned_token_ids() == {5, 3}
    assert request.needs_known_tokens  # a word of several tokens follows the output
    request.token_ids += [4]
    assert request.banned_token_ids() == {5}
