"""Speculative decoding on a tiny GLM-5 checkpoint with its MTP layer (`model.layers.3.*`):
the drafts equal a transformers-built reference of vLLM's DeepSeek MTP step at every step of a
request (chunked prefill, verify steps, sparse attention past index_topk); greedy output equals
greedy output without drafts, token for token, through batches, chunked prefill, prefix hits,
preemption, stops and length limits inside an accepted run (drafts from the MTP layer, random:
rejected, and from an oracle that knows plain decoding's output and spoils some of it: accepted
from none to all); sampled output follows the model's distribution (chi-square)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pegainfer import SamplingParams
from pegainfer.core.speculative.drafter import Drafter, DraftInputs, Drafts
from pegainfer.core.speculative.mtp import MTPDrafter
from pegainfer.models.glm5.line import Glm5Line
from tests.engine_harness import drain, generate, greedy, make_engine, submit
from tests.glm5.hf_reference import VOCAB, load_hf, write_hf_checkpoint
from tests.speculative_harness import (
    check_preemption_and_stops,
    check_stop_string_inside_an_accepted_run,
    chi_square,
    chi_square_999,
    mtp_oracle_engine,
    random_prompts,
    sequences_of,
)

# Three layers (one dense, two MoE) keep the CPU's attention quick; the MTP layer is the 4th.
LAYERS = {"num_hidden_layers": 3, "first_k_dense_replace": 1}
MTP = LAYERS["num_hidden_layers"]


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("glm5-speculative")
    return write_hf_checkpoint(folder, seed=4, mtp=True, **LAYERS)


prompts = partial(random_prompts, vocab=VOCAB)
oracle_engine = partial(mtp_oracle_engine, vocab=VOCAB)


class MTPReference:
    """vLLM's DeepSeek MTP step written with transformers: the main model's final hidden
    states h_i; eh_proj over [enorm(embed(token i + 1)), hnorm(h_i)] (the embedding zero at
    position 0); the MTP decoder layer as the one layer of a transformers GLM-5 (MoE, its own
    indexer); greedy over `shared_head.head` of `shared_head.norm` of its output; later drafts
    from that output (before the norm), one position on. Every position is computed afresh:
    what the engine's MTP caches must hold."""

    def __init__(self, path: Path, workdir: Path) -> None:
        """`workdir`: where the one-layer model's checkpoint is written (transformers reads
        the published per-expert layout only through `from_pretrained`)."""
        self.hf = load_hf(path)
        one_layer = {"num_hidden_layers": 1, "first_k_dense_replace": 0,
                     "mlp_layer_types": ["sparse"], "indexer_types": ["full"],
                     "layer_types": ["indexed_attention"]}  # fmt: skip
        config = self.hf.config.__class__(**(self.hf.config.to_dict() | one_layer))
        tensors = load_file(path / "model.safetensors")
        prefix = f"model.layers.{MTP}."
        state = {"model.embed_tokens.weight": tensors["model.embed_tokens.weight"],
                 "model.norm.weight": tensors[prefix + "shared_head.norm.weight"],
                 "lm_head.weight": tensors[prefix + "shared_head.head.weight"]}  # fmt: skip
        block = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
        state |= {name.replace(prefix, "model.layers.0."): t for name, t in tensors.items()
                  if name.startswith(prefix) and name[len(prefix) :].split(".")[0] in block
                  }  # fmt: skip
        config.save_pretrained(workdir)
        save_file(state, workdir / "model.safetensors", metadata={"format": "pt"})
        self.mtp = transformers.GlmMoeDsaForCausalLM.from_pretrained(workdir, dtype=torch.float32)
        self.mtp.eval()
        self.tensors = {leaf: tensors[prefix + leaf + ".weight"]
                        for leaf in ("enorm", "hnorm", "eh_proj")}  # fmt: skip
        self.eps = config.rms_norm_eps
        self._layer_out: list[torch.Tensor] = []
        self.mtp.model.layers[0].register_forward_hook(
            lambda _module, _args, out: self._layer_out.append(out[0])
        )

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def _rows(self, tokens: list[int], hidden: torch.Tensor, first: int) -> torch.Tensor:
        """The layer's inputs for positions first.. (token i + 1 and the state at i)."""
        embedded = self.mtp.model.embed_tokens(torch.tensor(tokens))
        if first == 0:
            embedded[0] = 0.0
        x = torch.cat([self._norm(embedded, self.tensors["enorm"]),
                       self._norm(hidden, self.tensors["hnorm"])], dim=-1)  # fmt: skip
        return x @ self.tensors["eh_proj"].T

    @torch.inference_mode()
    def drafts(self, sequence: list[int], k: int) -> list[int]:
        """The k drafts after `sequence` (whose last token has no KV yet)."""
        hidden = self.hf.model(torch.tensor([sequence[:-1]])).last_hidden_state[0]
        rows = self._rows(sequence[1:], hidden, 0)
        drafts: list[int] = []
        for _ in range(k):
            self._layer_out.clear()
            logits = self.mtp(inputs_embeds=rows[None]).logits[0, -1]
            drafts.append(int(logits.argmax()))
            out = self._layer_out[0][0, -1:]
            rows = torch.cat([rows, self._rows([drafts[-1]], out, len(rows))])
        return drafts


def test_mtp_drafts_match_a_transformers_reference(path, tmp_path):
    """At every step of two requests (prompts prefilled in chunks, the longer past
    index_topk 8 so its attention is sparse, then verify steps whose random drafts are
    rejected), each request's drafts are the reference's for its tokens so far."""
    k = 3
    reference = MTPReference(path, tmp_path)
    engine = make_engine(path, speculative_tokens=k, max_num_batched_tokens=12)
    for i, prompt in enumerate(prompts(6, (23, 6))):
        submit(engine, str(i), prompt, greedy(8))
    checked = 0
    while engine.has_unfinished_requests:
        engine.step()
        for request in engine.requests.values():
            if request.draft_token_ids:
                expected = reference.drafts(request.token_ids, k)
                assert request.draft_token_ids == expected, request.request_id
                checked += 1
    assert checked >= 10


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_drafts_keep_greedy_output(path, k):
    """The MTP layer drafts (random weights: mostly rejected), prompts prefilled in chunks
    beside verify steps."""
    batch = prompts(1, (5, 13, 30, 2, 41))
    expected = generate(make_engine(path, max_num_batched_tokens=24), batch, greedy(16))
    engine = make_engine(path, speculative_tokens=k, max_num_batched_tokens=24)
    assert generate(engine, batch, greedy(16)) == expected
    assert engine.speculative.counters.num_draft_tokens > 0
    engine.block_manager.check_invariants()


@pytest.mark.parametrize(("k", "spoil"), [(2, True), (4, True), (3, False)])
def test_partial_and_full_acceptance(path, k, spoil):
    """Drafts accepted in part (the rejected ones' KV recomputed) or whole (the bonus token)."""
    batch = prompts(2, (9, 17, 33, 4))
    expected = generate(make_engine(path, max_num_batched_tokens=24), batch, greedy(20))
    engine = oracle_engine(path, k, sequences_of(batch, expected), spoil,
                           max_num_batched_tokens=24)  # fmt: skip
    assert generate(engine, batch, greedy(20)) == expected
    stats = engine.speculative.counters
    if spoil:
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        assert stats.accepted_per_pos[0] > stats.accepted_per_pos[min(k, 2) - 1] > 0
    else:
        assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


def test_prefix_hit(path, tmp_path):
    """A repeated prompt reuses the first request's latent, indexer-key and MTP blocks and
    continues as cold, its MTP drafts too (the reference's)."""
    prompt = prompts(3, (30,))[0]
    expected = generate(make_engine(path), [prompt], greedy(12))
    engine = make_engine(path, speculative_tokens=2)
    assert generate(engine, [prompt], greedy(12)) == expected
    submit(engine, "again", prompt, greedy(12))
    engine.step()  # the prompt's last token, after 28 tokens from the prefix cache
    assert engine.scheduler.counters.prefix_hits == 28
    request = engine.requests["again"]
    assert request.draft_token_ids == MTPReference(path, tmp_path).drafts(request.token_ids, 2)
    assert request.token_ids[len(prompt) :] + drain(engine)["again"] == expected[0]


def test_preemption_and_stops(path):
    """A pool too small for the batch preempts (drafts recomputed); EOS, min_tokens and
    max_tokens end requests inside accepted runs."""
    batch = prompts(5, (18, 25, 11, 30, 9))
    plain = generate(make_engine(path), batch, greedy(24))
    small = {"num_kv_blocks": 40, "max_model_len": 64}
    engine = check_preemption_and_stops(batch, plain, 24, make_engine(path, **small),
                                        lambda s: oracle_engine(path, 3, s, **small))  # fmt: skip
    stats = engine.speculative.counters
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


# GLM-5-FP8's quantization, in blocks the tiny widths hold whole.
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
       "weight_block_size": [32, 32]}  # fmt: skip


@pytest.mark.parametrize("quantization", [None, FP8], ids=["bf16", "fp8"])
def test_tiny_checkpoints_carry_the_mtp_layer(tmp_path, quantization):
    """`pegainfer-tiny glm5` writes the MTP layer (GLM-5-FP8's layout: its decoder layer's
    projections in FP8 blocks, eh_proj and its head unquantized), which drafts through
    `--speculative-config` as vLLM takes it; greedy output equals plain decoding's."""
    extra = {} if quantization is None else {"quantization_config": quantization}
    Glm5Line().write_tiny_checkpoint(tmp_path, seed=2, num_hidden_layers=2,
                                     first_k_dense_replace=1, **extra)  # fmt: skip
    tensors = load_file(tmp_path / "model.safetensors")
    layer = "model.layers.2."
    for leaf in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "shared_head.head.weight", "self_attn.indexer.wq_b.weight",
                 "mlp.experts.7.down_proj.weight", "mlp.gate.e_score_correction_bias"):  # fmt: skip
        assert layer + leaf in tensors, leaf
    quantized = quantization is not None
    assert (layer + "self_attn.q_a_proj.weight_scale_inv" in tensors) == quantized
    assert layer + "eh_proj.weight_scale_inv" not in tensors
    batch = prompts(7, (21, 4))
    expected = generate(make_engine(tmp_path), batch, greedy(8))
    config = '{"method": "glm4_moe_mtp", "num_speculative_tokens": 2}'
    engine = make_engine(tmp_path, speculative_config=config)
    assert isinstance(engine.speculative.drafter, MTPDrafter)
    assert generate(engine, batch, greedy(8)) == expected
    assert engine.speculative.counters.num_draft_tokens > 0


def test_stop_string_inside_an_accepted_run(tmp_path):
    """A stop string completed inside a run of accepted drafts ends the output there."""
    Glm5Line().write_tiny_checkpoint(tmp_path, seed=3, num_hidden_layers=2,
                                     first_k_dense_replace=1)  # fmt: skip
    check_stop_string_inside_an_accepted_run(tmp_path)


class ModeDrafter(Drafter):
    """One draft per request, deterministic: the target's most likely token after its prompt
    and the token it sampled (`modes`, by that token). It is kept with the probability the
    sampled distribution gives it, else the token is redrawn from the rest."""

    def __init__(self, modes: list[int]) -> None:
        super().__init__(1)
        self.modes = modes

    def propose(self, inputs: DraftInputs) -> Drafts:
        return Drafts([[self.modes[r.token_ids[-1]]] for r in inputs.drafted])


def test_sampled_output_follows_the_model(tmp_path):
    """Seeded requests at temperature 0.3, the second token drafted as the target's mode: the
    second tokens (drafts kept, or redrawn from the residual) follow the model's distribution
    of the second token, as transformers computes it (chi-square). Two layers (a dense one
    and a MoE one): a thousand requests through the CPU's attention take a while."""
    path = write_hf_checkpoint(tmp_path, seed=5, mtp=True, num_hidden_layers=2,
                               first_k_dense_replace=1)  # fmt: skip
    temperature, count = 0.3, 800
    prompt = prompts(9, (6,))[0]
    with torch.inference_mode():
        hf = load_hf(path)
        first = (hf(torch.tensor([prompt])).logits[0, -1].double() / temperature).softmax(-1)
        after = torch.tensor([[*prompt, t] for t in range(VOCAB)])  # every first token
        logits = hf(after).logits[:, -1].double()
    second = (logits / temperature).softmax(-1)  # [first token, second token]
    engine = make_engine(path, speculative_tokens=1, max_num_seqs=256)
    engine.speculative.drafter = ModeDrafter(logits.argmax(-1).tolist())
    for i in range(count):
        params = SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True, seed=i)
        submit(engine, str(i), prompt, params)
    outputs = drain(engine)
    stats = engine.speculative.counters
    assert stats.num_draft_tokens == count
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    expected = (first[:, None] * second).sum(0) * count
    observed = torch.bincount(torch.tensor([o[1] for o in outputs.values()]),
                              minlength=VOCAB).double()  # fmt: skip
    chi2, df = chi_square(observed, expected)
    assert chi2 < chi_square_999(df), (chi2, df)
