"""Random prompts of exact token lengths, made with the server's own tokenizer.

As vLLM's `RandomDataset`, prompts are random token ids, and text prompts are their decoding,
re-encoded and adjusted until the length is exact. Unlike it, nothing is tokenized locally:
the server's `/tokenize` and `/detokenize` do it, so lengths are exact in the tokenizer that
counts. Ids are drawn from the ordinary tokens the tokenizer produces for random ASCII words,
so no special token (a chat template's delimiters, an EOS) lands in a prompt and every id
decodes to whole characters.

Each prompt has its own generator, seeded by a key made of the run's seed and the prompt's
index, so prompts are the same from run to run whatever order the server answers in, and they
differ from their first token on: the prefix cache helps only where a shared prefix is asked for.
"""

from __future__ import annotations

import asyncio
import random
import string
from collections.abc import Sequence

from pegainfer.server.bench.client import BenchClient

_POOL_WORDS = 4000
_POOL_ALPHABET = string.ascii_letters + string.digits + "!#$%&()*+,-./:;<=>?@[]^_{|}~"
# Decode and re-encode rounds before giving up on a length; two or three are typical.
_MAX_ROUNDS = 50
# Tokenizer requests in flight while building prompts.
_CONCURRENCY = 32


class RandomTokens:
    """Random token ids and texts of exact lengths for one server, seeded by string keys.

    Callers put the run's seed into every key (`f"{seed}:{index}"`).
    """

    def __init__(self, client: BenchClient, pool: Sequence[int]) -> None:
        self.client = client
        self.pool = list(pool)

    @classmethod
    async def create(cls, client: BenchClient) -> RandomTokens:
        """Fetch the id pool: the server's tokens of random words (the same words every time)."""
        words = random.Random(0)
        text = " ".join(
            "".join(words.choices(_POOL_ALPHABET, k=words.randint(1, 8)))
            for _ in range(_POOL_WORDS)
        )
        return cls(client, sorted(set(await client.tokenize(text))))

    def ids(self, length: int, key: str) -> list[int]:
        """`length` random ids, the same for the same key."""
        return random.Random(key).choices(self.pool, k=length)

    async def text(self, length: int, key: str, prefix: Sequence[int] = ()) -> str:
        """Text the server tokenizes to exactly `length` tokens: `prefix` plus random ids, decoded.

        The decoding of random ids re-encodes to a few more or fewer tokens (neighbours merge);
        the re-encoding is cut to `length`, or extended with more random ids, until it is exact.
        """
        rng = random.Random(key)
        ids = [*prefix, *rng.choices(self.pool, k=length - len(prefix))]
        for _ in range(_MAX_ROUNDS):
            text = await self.client.detokenize(ids)
            ids = await self.client.tokenize(text)
            if len(ids) == length:
                return text
            ids = ids[:length] + rng.choices(self.pool, k=max(0, length - len(ids)))
        raise RuntimeError(f"no text of exactly {length} tokens after {_MAX_ROUNDS} rounds")

    async def texts(
        self, lengths: Sequence[int], keys: Sequence[str], prefix: Sequence[int] = ()
    ) -> list[str]:
        """`text` for each length and key, a bounded number of tokenizer requests at once."""
        limit = asyncio.Semaphore(_CONCURRENCY)

        async def one(length: int, key: str) -> str:
            async with limit:
                return await self.text(length, key, prefix)

        return await asyncio.gather(*(one(n, k) for n, k in zip(lengths, keys, strict=True)))
