"""The golden gate: teacher-forced logprobs of our engine against transformers (PegaInfer's method).

Random token sequences are prefilled, then a fixed continuation is fed one token per step
(teacher forcing, so both sides see the same context); at the last prompt position and after
each fed token, our next-token distribution is compared with transformers' on the same prefix:
- regret: transformers' logprob of its own argmax minus its logprob of ours (≤ 0.20 nat), and
  our argmax within transformers' top 64;
- over our top 8 tokens, |Δ logprob|: mean ≤ 0.06, p99 ≤ 0.20.
Passes drive the engine's model, KV cache and CUDA graphs directly, so batch composition,
graph buckets and cached prefixes are chosen exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pegainfer.core.engine.core import EngineCore
from pegainfer.core.runner.forward_batch import ForwardBatch

REGRET_TOL, MEAN_TOL, P99_TOL = 0.20, 0.06, 0.20
HEAD_K, HF_TOP = 8, 64


def write_gate_checkpoint(path: Path, config: dict, layer_out: float, seed: int = 0) -> None:
    """A random `Qwen3ForCausalLM` saved by transformers (bf16), shaped for the gate.

    transformers' own init (std 0.02) makes a chaotic network at real depth: its bf16 forward
    drifts from its float32 one by 0.25 nat on average at Qwen3-4B shapes, four times the
    gate's tolerance, and its next-token distributions are flat over the whole vocabulary.
    Three changes give peaked distributions that bf16 barely moves (measured on CPU at 4B
    shapes: top-1 probability ~0.9, transformers' bf16 within ~0.02 nat of its float32):
    - gate/up weights halved: the MLP's gain is what amplifies rounding through the layers;
    - embedding std 1/sqrt(hidden): the bulk of the logits spreads by ~1 nat;
    - o/down weights scaled by `layer_out`, so each token's own embedding keeps a share of
      the residual stream and its logit stands well above the bulk (the tied LM head).
    Norm weights are 1 + N(0, 0.1) so that a missing or misplaced norm shows.
    """
    import transformers

    cfg = transformers.Qwen3Config(
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True, initializer_range=0.02, dtype="bfloat16", **config,
    )  # fmt: skip
    torch.manual_seed(seed)
    with torch.device("cuda"):
        hf = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif name.endswith(("gate_proj.weight", "up_proj.weight")):
                param.mul_(0.5)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                param.mul_(layer_out)
        hf.model.embed_tokens.weight.normal_(0, cfg.hidden_size**-0.5)
    hf.save_pretrained(path)


@dataclass
class Case:
    prompt: list[int]
    continuation: list[int]

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.continuation


def make_cases(n: int, vocab: int, max_prompt: int, decode: int, seed: int) -> list[Case]:
    g = torch.Generator().manual_seed(seed)
    cases = []
    for _ in range(n):
        length = int(torch.randint(1, max_prompt + 1, (1,), generator=g))
        tokens = torch.randint(0, vocab, (length + decode,), generator=g).tolist()
        cases.append(Case(tokens[:length], tokens[length:]))
    return cases


@torch.inference_mode()
def reference_logprobs(hf, case: Case) -> torch.Tensor:
    """transformers' logprobs at the last prompt position and after each fed token [D+1, V]."""
    logits = hf(torch.tensor([case.tokens], device="cuda")).logits[0].float()
    return logits[len(case.prompt) - 1 :].log_softmax(-1)


@dataclass
class GateResult:
    regrets: list[float] = field(default_factory=list)
    deltas: list[float] = field(default_factory=list)
    outside_top: int = 0

    @property
    def positions(self) -> int:
        return len(self.regrets)

    def add(self, ours: torch.Tensor, ref: torch.Tensor) -> None:
        """Compare rows of our logits [N, V] with reference logprobs [N, V]."""
        ours_lp = ours.float().log_softmax(-1)
        pick = ours_lp.argmax(-1, keepdim=True)
        regret = ref.max(-1).values - ref.gather(-1, pick).squeeze(-1)
        self.regrets += regret.tolist()
        top = ref.topk(HF_TOP, dim=-1).indices
        self.outside_top += int((~(top == pick).any(-1)).sum())
        head = ours_lp.topk(HEAD_K, dim=-1).indices
        self.deltas += (ours_lp.gather(-1, head) - ref.gather(-1, head)).abs().flatten().tolist()

    def summary(self) -> dict[str, float]:
        deltas = torch.tensor(self.deltas)
        return {
            "positions": self.positions,
            "max_regret": max(self.regrets),
            "outside_hf_top64": self.outside_top,
            "mean_abs_delta": deltas.mean().item(),
            "p99_abs_delta": deltas.quantile(0.99).item(),
            "max_abs_delta": deltas.max().item(),
        }

    def check(self, label: str) -> None:
        s = self.summary()
        assert s["max_regret"] <= REGRET_TOL, (label, s)
        assert s["outside_hf_top64"] == 0, (label, s)
        assert s["mean_abs_delta"] <= MEAN_TOL, (label, s)
        assert s["p99_abs_delta"] <= P99_TOL, (label, s)


def judge(
    passes: dict[str, list[torch.Tensor]],
    refs16: list[torch.Tensor],
    refs32: list[torch.Tensor],
    out: Path | None = None,
    check: bool = True,
) -> dict[str, dict[str, float]]:
    """Score every pass against transformers in bf16 (the gate) and in float32, beside the
    floor (transformers' bf16 against its float32); write the table to `out`, then (with
    `check`) check every pass against bf16 at the gate's tolerances."""
    floor = GateResult()
    for ref16, ref32 in zip(refs16, refs32, strict=True):
        floor.add(ref16, ref32)
    summary = {"hf_bf16 vs hf_fp32 (floor)": floor.summary()}
    gates = {}
    for name, logits in passes.items():
        vs16, vs32 = GateResult(), GateResult()
        for ours, ref16, ref32 in zip(logits, refs16, refs32, strict=False):
            vs16.add(ours, ref16)
            vs32.add(ours, ref32)
        summary[f"{name} vs hf_bf16"] = vs16.summary()
        summary[f"{name} vs hf_fp32"] = vs32.summary()
        gates[name] = vs16
    if out is not None:
        out.write_text(json.dumps(summary, indent=2))
    if check:
        for name, gate in gates.items():
            gate.check(name)
    return summary


class TeacherForcer:
    """Runs cases through the engine's model with blocks taken from its block manager.

    For models with recurrent state, case i runs in state slot i; a cached-prefix pass
    checkpoints each state where its reused blocks end and restarts from there."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self.bs = engine.config.block_size
        self.stateful = engine.kv_cache.num_slots > 0
        self.first_checkpoint = engine.scheduler.config.max_num_seqs

    def _blocks(self, n_tokens: int, reuse: list[int]) -> list[int]:
        need = -(-n_tokens // self.bs) - len(reuse)
        fresh = self.engine.block_manager.allocate(need)
        assert fresh is not None, "the KV cache is too small for this pass"
        return reuse + fresh

    def _step(
        self, chunks, starts, tables, graphs: bool, slots=None, restore=None, snapshot=None
    ) -> torch.Tensor:
        if self.stateful and slots is None:
            slots = list(range(len(chunks)))
        batch = ForwardBatch.build(
            chunks, starts, tables, [True] * len(chunks), self.bs, self.engine.runner.device,
            state_slots=slots, state_restore=restore, state_snapshot=snapshot,
        )  # fmt: skip
        eng = self.engine
        if graphs:  # as the engine runs it: a graph, the pieces of a mixed step, or eagerly
            logits = eng.runner.forward(batch).clone()
        else:
            eng.model.prepare(batch)
            logits = eng.model(batch, eng.kv_cache)
        torch.cuda.synchronize()  # as the engine's step does when it copies the tokens out
        return logits

    @torch.inference_mode()
    def run(
        self, cases: list[Case], graphs: bool = True, cached_prefix: bool = False
    ) -> list[torch.Tensor]:
        """Our logits [D+1, V] for each case, all cases batched together.

        With `cached_prefix`, each case is first run alone, then run again reusing the full
        blocks of its prompt, as a prefix-cache hit does, so only the rest is prefilled.
        """
        reuse: list[list[int]] = [[] for _ in cases]
        starts = [0] * len(cases)
        held: list[int] = []
        restore = None
        if cached_prefix:
            for i, case in enumerate(cases):
                table = self._blocks(len(case.prompt), [])
                full = (len(case.prompt) - 1) // self.bs
                snapshot = [(full * self.bs, self.first_checkpoint + i)] if self.stateful else None
                self._step([case.prompt], [0], [table], graphs=False, snapshot=snapshot)
                reuse[i], starts[i] = table[:full], full * self.bs
                held += table
            if self.stateful:
                restore = [self.first_checkpoint + i if s else None for i, s in enumerate(starts)]
        tables = [self._blocks(len(c.tokens), r) for c, r in zip(cases, reuse, strict=True)]
        out = [[] for _ in cases]
        logits = self._step(
            [c.prompt[s:] for c, s in zip(cases, starts, strict=True)],
            starts,
            tables,
            graphs=False,
            restore=restore,
        )
        for i in range(len(cases)):
            out[i].append(logits[i])
        for t in range(len(cases[0].continuation)):
            chunks = [[c.continuation[t]] for c in cases]
            positions = [len(c.prompt) + t for c in cases]
            logits = self._step(chunks, positions, tables, graphs)
            for i in range(len(cases)):
                out[i].append(logits[i])
        for table, r in zip(tables, reuse, strict=True):
            self.engine.block_manager.release(table[len(r) :])
        self.engine.block_manager.release(held)
        return [torch.stack(rows) for rows in out]


def small_gate_passes(forcer: TeacherForcer, cases: list[Case]) -> dict[str, list[torch.Tensor]]:
    """The small gate's passes over 9 cases: batched in the 16-graph, 5 of them in the 8-graph,
    after a prefix hit, and eagerly."""
    return {
        "batch9_graph16": forcer.run(cases),
        "batch5_graph8": forcer.run(cases[:5]),
        "prefix_hit": forcer.run(cases, cached_prefix=True),
        "eager": forcer.run(cases, graphs=False),
    }


def real_shape_gate_passes(
    forcer: TeacherForcer, cases: list[Case]
) -> dict[str, list[torch.Tensor]]:
    """The real-shape gate's passes: the first 9 cases at batch 1, twice (bit-identical), then
    every case in batches of 9 in the 16-graph, and again after a prefix hit."""
    passes: dict[str, list[torch.Tensor]] = {"batch1_run1": [], "batch1_run2": []}
    for case in cases[:9]:
        first, second = forcer.run([case])[0], forcer.run([case])[0]
        assert torch.equal(first, second), "batch-1 replay is not deterministic"
        passes["batch1_run1"].append(first)
        passes["batch1_run2"].append(second)
    for name, cached in (("batch9_graph16", False), ("prefix_hit_batch9", True)):
        passes[name] = []
        for start in range(0, len(cases), 9):
            passes[name] += forcer.run(cases[start : start + 9], cached_prefix=cached)
    return passes


def judge_with_long_prompt(
    passes: dict[str, list[torch.Tensor]],
    long_pass: dict[str, list[torch.Tensor]],
    refs16: list[torch.Tensor],
    refs32: list[torch.Tensor],
    out: Path | None,
) -> None:
    """Judge the passes (references for the cases, then the long prompt's, last) and the long
    prompt's pass; both tables are printed and written (`out`, and `out`'s name with
    `_prompt_N` for the long one) before either is checked."""
    name = next(iter(long_pass))
    long_out = None if out is None else out.with_name(f"{out.stem}_{name}.json")
    print(json.dumps(judge(long_pass, refs16[-1:], refs32[-1:], long_out, check=False), indent=2))
    print(json.dumps(judge(passes, refs16[:-1], refs32[:-1], out), indent=2))
    judge(long_pass, refs16[-1:], refs32[-1:])


def assert_graph_replay_equals_eager(engine: EngineCore) -> None:
    """A decode replay computes exactly what the same kernels compute eagerly, padding
    included (five sequences in the 8-graph), for a model without recurrent state."""
    forcer, bs, cuda = TeacherForcer(engine), engine.config.block_size, torch.device("cuda")
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 40, 1, 33)]
    tables = [engine.block_manager.allocate(-(-(len(p) + 1) // bs)) for p in prompts]
    forcer._step(prompts, [0] * 5, tables, graphs=False)
    batch = ForwardBatch.build([[7]] * 5, [len(p) for p in prompts], tables, [True] * 5, bs, cuda)
    assert engine.runner.graphs.can_run(batch)
    replayed = engine.runner.graphs.run(batch).clone()
    padded = engine.runner.graphs._padded(8, batch.seq_lens_cpu, batch.block_tables_cpu, [])
    padded.input_ids[:5].copy_(batch.input_ids)
    padded.positions[:5].copy_(batch.positions)
    padded.slot_mapping[:5].copy_(batch.slot_mapping)
    with torch.inference_mode():
        engine.model.prepare_graph(padded, 8)
        eager = engine.model(padded, engine.kv_cache)[:5]
    assert torch.equal(replayed, eager)
    for table in tables:
        engine.block_manager.release(table)


# Prefill chunk lengths beside three decodes: four token buckets, one- and many-chunk steps.
PIECEWISE_LENGTHS = [(33, 1, 70), (300,), (16, 16), (1000, 24)]


def assert_pieces_match_eager(engine: EngineCore, lengths: tuple[int, ...]) -> None:
    """Decodes beside prefill chunks of `lengths`, replayed through the piecewise graphs
    (attention eager between the pieces, rows padded to the token bucket), give the eager
    step's logits at the gate's tolerances (the padded GEMMs may pick other kernels)."""
    runner = engine.runner
    assert runner.mixed_graphs is not None
    bs, cuda = engine.config.block_size, torch.device("cuda")
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 40)]
    tables = [engine.block_manager.allocate(-(-(len(p) + 1) // bs)) for p in prompts]
    TeacherForcer(engine)._step(prompts, [0] * 3, tables, graphs=False)
    fresh = [[(11 * i + k) % 1000 for k in range(n)] for i, n in enumerate(lengths)]
    tables += [engine.block_manager.allocate(-(-len(p) // bs)) for p in fresh]
    chunks = [[7], [8], [9], *fresh]
    starts = [len(p) for p in prompts] + [0] * len(fresh)
    batch = ForwardBatch.build(chunks, starts, tables, [True] * len(chunks), bs, cuda)
    assert runner.mixed_graphs.can_run(batch) and not runner.graphs.can_run(batch)
    with torch.inference_mode():
        runner.mixed_graphs.capture_missing(batch)  # a bucket past the first ones: lazily
        pieces = runner.mixed_graphs.run(batch).float().log_softmax(-1)
        engine.model.prepare(batch)
        eager = engine.model(batch, engine.kv_cache).float().log_softmax(-1)
    gate = GateResult()
    gate.add(pieces, eager)
    gate.check("piecewise mixed step")
    for table in tables:
        engine.block_manager.release(table)
