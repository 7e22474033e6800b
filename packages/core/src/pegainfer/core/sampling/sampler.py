"""Token selection: greedy, temperature, top-k, top-p, min-p, logit bias, allowed and banned
tokens, per-request seeds.

This is the reference implementation and the CPU path. The filters apply in a fixed order on
the temperature-scaled distribution: top-k, then top-p on what remains, then min-p relative
to the most likely token. A token is then drawn by the exponential race (argmax of p / q with
q ~ Exp(1)), which equals sampling from the renormalised distribution and needs no host sync.
Requests with a seed draw their noise from their own generator, so their tokens do not depend
on what else shares the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pegainfer.core.engine.messages import TokenLogprob
from pegainfer.core.engine.request import Request
from pegainfer.core.runner.forward_batch import to_device, to_device_array
from pegainfer.core.sampling.grammar_mask import mask_logits


@dataclass(frozen=True)
class Penalties:
    presence: float
    frequency: float
    repetition: float
    prompt_ids: list[int]
    output_ids: list[int]

    def apply(self, logits: torch.Tensor) -> None:
        """Penalise one row of logits in place, as vLLM does: the repetition penalty on every
        token seen (divide positive logits, multiply negative ones), then the frequency and
        presence penalties on the output's counts."""
        vocab = logits.shape[-1]
        if self.repetition != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            seen[to_device(self.prompt_ids + self.output_ids, logits.device)] = True
            penalised = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
            logits.copy_(torch.where(seen, penalised, logits))
        if self.output_ids and (self.presence or self.frequency):
            counts = torch.bincount(to_device(self.output_ids, logits.device), minlength=vocab).to(
                logits.dtype
            )
            logits -= self.frequency * counts + self.presence * (counts > 0).to(logits.dtype)


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step, aligned with the logits rows."""

    temperature: torch.Tensor  # [B] float32; rows with 0 are greedy
    top_k: torch.Tensor  # [B] int64; vocab size when off
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    generators: list[torch.Generator]
    banned: list[frozenset[int]]  # tokens a row may not pick (stops before min_tokens)
    biases: list[dict[int, float]] = field(default_factory=list)  # per row: logit_bias
    allowed: list[list[int] | None] = field(default_factory=list)  # per row: the only picks
    # Per row with penalties: (presence, frequency, repetition, prompt ids, output ids).
    penalties: list[Penalties | None] = field(default_factory=list)
    #: Whether every row is greedy (read once, from the host tensor, before `to` moves it).
    all_greedy: bool = field(init=False)

    def __post_init__(self) -> None:
        self.all_greedy = bool((self.temperature == 0).all())

    @classmethod
    def from_requests(
        cls,
        requests: Sequence[Request],
        vocab_size: int,
        default_generator: torch.Generator,
        device: torch.device,
        continuations: Sequence[Sequence[int]] | None = None,
    ) -> SamplingBatch:
        """Rows for `requests` (one may fill several rows); `continuations[i]`: tokens taken
        to follow row i's request's output (speculative decoding's drafts before the row)."""
        params = [r.params for r in requests]
        after = continuations or [()] * len(requests)
        return cls(
            temperature=torch.tensor(
                [0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32
            ),
            top_k=torch.tensor(
                [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
            ),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32),
            generators=[r.generator or default_generator for r in requests],
            banned=[r.banned_token_ids(c) for r, c in zip(requests, after, strict=True)],
            biases=[p.logit_bias for p in params],
            allowed=[p.allowed_token_ids for p in params],
            penalties=[
                _penalties(r, c) if r.params.has_penalties else None
                for r, c in zip(requests, after, strict=True)
            ],
        ).to(device)

    def to(self, device: torch.device) -> SamplingBatch:
        """The per-row tensors on `device`; from the host to CUDA without waiting for the
        device (pinned, non-blocking)."""
        tensors = (self.temperature, self.top_k, self.top_p, self.min_p)
        if device.type == "cuda" and not self.temperature.is_cuda:
            tensors = tuple(t.pin_memory().to(device, non_blocking=True) for t in tensors)
        else:
            tensors = tuple(t.to(device) for t in tensors)
        self.temperature, self.top_k, self.top_p, self.min_p = tensors
        return self


def filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution each row samples from, unnormalised: filtered tokens have mass 0."""
    temperature = torch.where(batch.temperature > 0, batch.temperature, 1.0)
    logits = logits / temperature[:, None]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= batch.top_k[:, None], -torch.inf)
    probs = sorted_logits.softmax(dim=-1)
    # top-p keeps the smallest head whose mass reaches top_p: a token stays while the mass
    # before it is below top_p (so the most likely token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(mass_before >= batch.top_p[:, None], 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    probs = probs.masked_fill(probs < batch.min_p[:, None] * probs[:, :1], 0.0)
    return torch.empty_like(probs).scatter_(-1, order, probs)


def adjust_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """`logits` [B, V] in float32 after each row's logit bias, penalties, banned and allowed
    tokens (a copy when any applies: the caller's logits stay as they were)."""
    logits = logits.float()
    restricted = any(a is not None for a in batch.allowed)
    if any(batch.biases) or any(batch.banned) or any(batch.penalties) or restricted:
        logits = logits.clone()  # the caller's logits stay as they were
    for row, bias in enumerate(batch.biases):
        if bias:
            ids = to_device(list(bias), logits.device)
            values = np.fromiter(bias.values(), np.float32, len(bias))
            logits[row, ids] += to_device_array(values, logits.device)
    for row, penalties in enumerate(batch.penalties):
        if penalties is not None:
            penalties.apply(logits[row])
    for row, banned in enumerate(batch.banned):
        if banned:
            logits[row, to_device(sorted(banned), logits.device)] = -torch.inf
    for row, allowed in enumerate(batch.allowed):
        if allowed is not None:
            ids = to_device(list(allowed), logits.device)
            kept = logits[row, ids]
            logits[row] = -torch.inf
            logits[row, ids] = kept
    return logits


def exponential_noise(
    shape: tuple[int, int], generators: Sequence[torch.Generator], device: torch.device
) -> torch.Tensor:
    """Exp(1) noise [B, V], row i drawn from `generators[i]` (rows of one generator in turn)."""
    noise = torch.empty(shape, device=device)
    for row, generator in enumerate(generators):
        noise[row].exponential_(generator=generator)
    return noise


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The exponential race: argmax of p / q per row, a draw from the renormalised `probs`."""
    return (probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Pick one token per row of `logits` [B, V]; returns int64 [B]."""
    logits = adjust_logits(logits, batch)
    greedy = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy
    probs = filtered_probs(logits, batch)
    sampled = race(probs, exponential_noise(probs.shape, batch.generators, probs.device))
    return torch.where(batch.temperature > 0, sampled, greedy)


def target_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution each row's token is drawn from, normalised (`sample` draws from it):
    after the adjustments and filters, and one-hot at the argmax for greedy rows."""
    logits = adjust_logits(logits, batch)
    one_hot = torch.zeros_like(logits).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    if batch.all_greedy:
        return one_hot
    probs = filtered_probs(logits, batch)
    return torch.where(batch.temperature[:, None] > 0, probs, one_hot)


def sample_requests(
    logits: torch.Tensor,
    requests: Sequence[Request],
    vocab_size: int,
    default_generator: torch.Generator,
) -> torch.Tensor:
    """One token per request (rows of `logits` in request order), on the logits' device: the
    caller copies them to the host once, when it needs them.

    Rows with a grammar first lose the tokens it forbids. All-greedy batches without banned
    tokens skip building per-row parameters.
    """
    constrained = [(row, r.grammar) for row, r in enumerate(requests)
                   if r.grammar is not None and not r.grammar.is_error()]  # fmt: skip
    if constrained:
        rows, matchers = zip(*constrained, strict=True)
        logits = mask_logits(logits, list(rows), list(matchers))
    if all(plain_greedy(r) for r in requests):
        return logits.argmax(dim=-1)
    batch = SamplingBatch.from_requests(requests, vocab_size, default_generator, logits.device)
    return sample(logits, batch)


def plain_greedy(request: Request, continuation: Sequence[int] = ()) -> bool:
    """Whether the request's next token (after `continuation`) is the logits' argmax: greedy,
    with nothing that adjusts its logits."""
    p = request.params
    return (p.greedy and not request.banned_token_ids(continuation) and not p.logit_bias
            and not p.has_penalties and p.allowed_token_ids is None)  # fmt: skip


def _penalties(request: Request, continuation: Sequence[int] = ()) -> Penalties:
    """A request's penalties over its tokens so far (all known: the engine brings pending
    tokens home before scheduling a request with penalties), then `continuation`."""
    p, split = request.params, request.num_prompt_tokens
    assert not request.num_pending, "penalties need every sampled token on the host"
    output = [*request.token_ids[split:], *continuation]
    return Penalties(p.presence_penalty, p.frequency_penalty, p.repetition_penalty,
                     request.token_ids[:split], output)  # fmt: skip


@dataclass
class ScoredTokens:
    """Given tokens' logprobs, ranks (1: the most likely) and top alternatives at given rows of
    the logits, from the model's own distribution (before temperature, penalties, biases or
    masks, as vLLM reports them by default); on the logits' device until `to_host`."""

    counts: list[int]  # alternatives each row asked for
    logprob: torch.Tensor  # [R]
    rank: torch.Tensor  # [R]
    top_logprobs: torch.Tensor  # [R, K]
    top_ids: torch.Tensor  # [R, K]

    @classmethod
    def of(
        cls, logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, counts: list[int]
    ) -> ScoredTokens:
        logprobs = logits[rows].float().log_softmax(dim=-1)
        chosen = logprobs.gather(1, targets[:, None]).squeeze(1)
        rank = (logprobs > chosen[:, None]).sum(dim=1) + 1
        top_logprobs, top_ids = logprobs.topk(max(counts), dim=-1)
        return cls(counts, chosen, rank, top_logprobs, top_ids)

    @classmethod
    def sampled(
        cls, logits: torch.Tensor, tokens: torch.Tensor, requests: Sequence[Request]
    ) -> tuple[list[int], ScoredTokens] | None:
        """The sampled tokens of the requests that ask for logprobs, and those rows."""
        rows = [row for row, r in enumerate(requests) if r.params.logprobs is not None]
        if not rows:
            return None
        index = to_device(rows, logits.device)
        counts = [requests[row].params.logprobs or 0 for row in rows]
        return rows, cls.of(logits, index, tokens[index], counts)

    def to_host_async(self) -> ScoredTokens:
        """The same scores, being copied to the host behind the work queued so far (read them
        with `to_host` once that work is done)."""
        tensors = (self.logprob, self.rank, self.top_logprobs, self.top_ids)
        return ScoredTokens(self.counts, *(t.to("cpu", non_blocking=True) for t in tensors))

    def to_host(self, targets: list[int]) -> list[TokenLogprob]:
        logprob, rank = self.logprob.tolist(), self.rank.tolist()
        top_logprobs, top_ids = self.top_logprobs.tolist(), self.top_ids.tolist()
        return [
            TokenLogprob(target, logprob[i], rank[i],
                         list(zip(top_ids[i][:k], top_logprobs[i][:k], strict=True)))
            for i, (target, k) in enumerate(zip(targets, self.counts, strict=True))
        ]  # fmt: skip
