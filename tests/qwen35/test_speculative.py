"""Speculative decoding on a tiny Qwen3.5 checkpoint (with its MTP layer): greedy output equals
greedy output without drafts, token for token, while the recurrent state rolls back to the last
accepted token whenever a draft is rejected: batches, chunked prefill, prefix hits from state
checkpoints, preemption, stops and length limits inside an accepted run. Drafts come from the
checkpoint's MTP layer (random weights: rejected) and from an oracle that knows plain decoding's
output and spoils some of it (acceptance from none to all, at every draft index)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from pegainfer.core.errors import ConfigError
from pegainfer.models.qwen35.line import Qwen35Line
from tests.engine_harness import generate, greedy, make_engine, submit
from tests.speculative_harness import (
    check_preemption_and_stops,
    mtp_oracle_engine,
    random_prompts,
    sequences_of,
)

VOCAB = 1000  # prompt ids are drawn below this (the tiny tokenizer's vocabulary is larger)


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen35-speculative")
    Qwen35Line().write_tiny_checkpoint(path, seed=4)
    return path


prompts = partial(random_prompts, vocab=VOCAB)
oracle_engine = partial(mtp_oracle_engine, vocab=VOCAB)


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_drafts_keep_greedy_output(path, k):
    """The checkpoint's MTP layer drafts (its random weights' drafts are rejected: every verify
    step rolls the state back), prompts prefilled in chunks beside verify steps."""
    batch = prompts(1, (5, 13, 30, 2, 41))
    expected = generate(make_engine(path, max_num_batched_tokens=24), batch, greedy(20))
    engine = make_engine(path, speculative_tokens=k, max_num_batched_tokens=24)
    assert generate(engine, batch, greedy(20)) == expected
    assert engine.speculative.counters.num_draft_tokens > 0
    engine.block_manager.check_invariants()


@pytest.mark.parametrize(("k", "spoil"), [(2, True), (4, True), (3, False)])
def test_rollback_after_partial_acceptance(path, k, spoil):
    """Drafts accepted in part (the state rolls back to the last accepted token, the accepted
    ones run again) or whole (nothing to roll back)."""
    batch = prompts(2, (9, 17, 33, 4))
    expected = generate(make_engine(path, max_num_batched_tokens=24), batch, greedy(24))
    engine = oracle_engine(path, k, sequences_of(batch, expected), spoil,
                           max_num_batched_tokens=24)  # fmt: skip
    assert generate(engine, batch, greedy(24)) == expected
    stats = engine.speculative.counters
    if spoil:
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        # One draft in three is spoiled: runs of up to two are accepted.
        assert stats.accepted_per_pos[0] > stats.accepted_per_pos[min(k, 2) - 1] > 0
    else:
        assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


def test_prefix_hit_from_a_state_checkpoint(path):
    """A repeated prompt restarts from the state checkpoint and blocks the first one left (its
    verify steps never checkpoint drafts) and continues as cold."""
    prompt = prompts(3, (30,))[0]
    expected = generate(make_engine(path), [prompt], greedy(16))
    engine = oracle_engine(path, 3, {"0": prompt + expected[0], "1": prompt + expected[0]})
    assert generate(engine, [prompt], greedy(16)) == expected
    submit(engine, "1", prompt, greedy(16))
    outputs: list[int] = []
    while engine.has_unfinished_requests:
        for output in engine.step():
            outputs += output.new_token_ids
    assert outputs == expected[0]
    assert engine.scheduler.counters.prefix_hits > 0


def test_preemption_and_stops(path):
    """A pool too small for the batch preempts (state and drafts recomputed); EOS, min_tokens
    and max_tokens end requests inside accepted runs."""
    batch = prompts(5, (18, 25, 11, 30, 9))
    plain = generate(make_engine(path), batch, greedy(30))
    small = {"num_kv_blocks": 48, "max_model_len": 64}
    check_preemption_and_stops(batch, plain, 30, make_engine(path, **small),
                               lambda s: oracle_engine(path, 3, s, **small))  # fmt: skip


def test_self_drafts_are_refused(path):
    with pytest.raises(ConfigError, match="recurrent state"):
        make_engine(path, speculative_tokens=2, speculative_method="self")


def _zero_centred_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight)


def test_mtp_drafts_match_a_transformers_reference(path):
    """The drafts equal what vLLM's Qwen3.5 MTP step computes, written with transformers: its
    main model's final hidden states h_i, fc over [norm_e(embed(token i + 1)), norm_h(h_i)],
    the `mtp.layers.0` decoder layer (a one-layer transformers model holding it, its final norm
    `mtp.norm`, the tied head), greedy; later drafts from the layer's own output, one position
    on."""
    import transformers
    from safetensors.torch import load_file

    k = 4
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    one_layer = {"num_hidden_layers": 1, "layer_types": ["full_attention"]}
    config = hf.config.__class__(**(hf.config.to_dict() | one_layer))
    mtp = transformers.Qwen3_5ForCausalLM(config).eval()
    tensors = load_file(path / "model.safetensors")
    state = {"model.embed_tokens.weight": tensors["model.language_model.embed_tokens.weight"],
             "model.norm.weight": tensors["mtp.norm.weight"]}  # fmt: skip
    state |= {name.replace("mtp.layers.0.", "model.layers.0."): t
              for name, t in tensors.items() if name.startswith("mtp.layers.0.")}  # fmt: skip
    mtp.load_state_dict(state, strict=False)
    eps = config.rms_norm_eps

    def fc(tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        embedded = mtp.model.embed_tokens(torch.tensor(tokens))
        norm_e, norm_h = (tensors[f"mtp.pre_fc_norm_{n}.weight"] for n in ("embedding", "hidden"))
        x = torch.cat([_zero_centred_norm(embedded, norm_e, eps),
                       _zero_centred_norm(hidden, norm_h, eps)], dim=-1)  # fmt: skip
        return x @ tensors["mtp.fc.weight"].T

    engine = make_engine(path, speculative_tokens=k)
    for i, prompt in enumerate(prompts(6, (23, 5, 40, 12, 31, 2))):
        with torch.inference_mode():
            main = hf.model(torch.tensor([prompt]))
            first = int(hf.lm_head(main.last_hidden_state[0, -1]).argmax())
            rows = fc([*prompt[1:], first], main.last_hidden_state[0])
            expected = []
            for _ in range(k):
                out = mtp.model(inputs_embeds=rows[None]).last_hidden_state[0]
                expected.append(int(mtp.lm_head(out[-1]).argmax()))
                rows = torch.cat([rows, fc([expected[-1]], out[-1:])])
        submit(engine, str(i), prompt, greedy(2))
        (output,) = engine.step()  # the prefill: the first token, then the drafts after it
        assert output.new_token_ids == [first]
        assert engine.requests[str(i)].draft_token_ids == expected
        engine.abort([str(i)])
