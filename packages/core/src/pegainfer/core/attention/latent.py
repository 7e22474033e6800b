"""Multi-head latent attention (MLA) over a paged latent cache, in its absorbed and expanded
forms: one interface, torch references and FlashInfer backends.

MLA (DeepSeek-V2/V3, Kimi-K2, GLM-5) caches per token one latent c and one roped key k_pe
shared by all heads (`ops.latent_attention`); each head's key is [W_uk c | k_pe] and its value
W_uv c, with W_uk, W_uv the rows of the line's `kv_b` up-projection. Both forms give the same
result in exact arithmetic and differ in cost:

- absorbed: W_uk folds into the query and W_uv applies after, so attention runs in latent space
  (q·k over latent + rope dims, the output in latent dims) straight over the paged cache;
- expanded: the sequence's cached latents are up-projected to per-head keys and values, then
  ordinary causal attention (q·k over nope + rope dims, values of `value_dim`).

The up-projections cost 2·latent·(nope + value) FLOPs per head and token they touch: the
expanded form projects the sequence's every cached token, the absorbed one each query row (W_uk
in, W_uv out); per (row, visible token) pair the expanded form then saves 2(2·latent + rope) −
2(nope + rope + value) per head. So a chunk of q rows over a prefix of P tokens attends
expanded when P·projection < pairs·saving, pairs = q·P + q(q+1)/2 (`LatentShape.expands`): a
prompt from position 0 always, a decode never, a chunk after a long prefix from ~171 rows at
DeepSeek's 512/64/128/128. The expanded form holds the up-projected keys and values of the
step's expanded sequences at once, so a step expands at most `_EXPANDED_TOKEN_HEADS` cached
tokens × heads (~1.2 GB in bf16 at DeepSeek's sizes, left free by the KV cache:
`MultiHeadLatentAttention.transient_bytes`); sequences past that attend absorbed.

As for GQA (`core.attention.paged`), a model plans once per step outside any CUDA graph and calls
`run` in every layer; pure-decode steps (all absorbed) replay graphs planned per batch-size
bucket over fixed index buffers. FlashInfer's MLA kernels take a latent of 512 and a rope key of
64 (every DeepSeek-V2/V3-style checkpoint); other sizes (the tiny test models) run the
references.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pegainfer.core.attention.paged import PagedIndex, PlanStaging, Split, share_plan_buffers
from pegainfer.core.errors import ConfigError
from pegainfer.core.model_line import RuntimeConfig
from pegainfer.core.ops.latent_attention import paged_latent_attention, ragged_attention
from pegainfer.core.runner.forward_batch import ForwardBatch

_WORKSPACE_BYTES = 128 << 20
# (latent_dim, rope_dim) FlashInfer's MLA kernels are built for.
FLASHINFER_LATENT_SHAPES = {(512, 64)}
# The most cached tokens × heads one step up-projects for the expanded form.
_EXPANDED_TOKEN_HEADS = 1 << 20
# FlashInfer's MLA planner (`MLAPlan`, FA2 and FA3 alike) lays its schedule out for this many
# work items and does not check: a step that needs more overruns its buffers.
MLA_PLAN_WORK_ITEMS = 16384


def _mla_plan_tiling(num_heads: int, num_sms: int) -> tuple[int, int]:
    """(rows of a tile, clusters) the planner may pick: 128 and SMs / 2 when every sequence
    packs more than 64 rows × heads (always past 64 heads), else 64 and up to SMs."""
    return (128, num_sms // 2) if num_heads > 64 else (64, num_sms)


def mla_plan_work_items(num_heads: int, max_tokens: int, max_seqs: int, num_sms: int) -> int:
    """The most work items FlashInfer's MLA planner makes for a step of at most `max_tokens`
    query rows in at most `max_seqs` sequences. It tiles each sequence's rows × heads (at
    most rows·heads/tile + 1 tiles a sequence), then cuts each tile's keys in pieces of at
    least total keys / clusters, so the pieces number at most tiles + clusters."""
    tile, clusters = _mla_plan_tiling(num_heads, num_sms)
    return clusters + -(-max_tokens * num_heads // tile) + max_seqs


def check_mla_plan_fits(num_heads: int, max_tokens: int, max_seqs: int, num_sms: int) -> None:
    """Refuse step budgets whose worst step would overrun FlashInfer's MLA planner."""
    worst = mla_plan_work_items(num_heads, max_tokens, max_seqs, num_sms)
    if worst <= MLA_PLAN_WORK_ITEMS:
        return
    tile, clusters = _mla_plan_tiling(num_heads, num_sms)
    fits = (MLA_PLAN_WORK_ITEMS - clusters - max_seqs) * tile // num_heads
    advice = (f"set --max-num-batched-tokens to at most {fits}" if fits >= max_seqs
              else "lower --max-num-seqs")  # fmt: skip
    raise ConfigError(
        f"a step of {max_tokens} tokens in {max_seqs} sequences at {num_heads} attention heads "
        f"per GPU can need {worst} work items in FlashInfer's MLA planner, which holds "
        f"{MLA_PLAN_WORK_ITEMS}: {advice}"
    )


@dataclass(frozen=True)
class LatentShape:
    num_heads: int
    latent_dim: int
    rope_dim: int
    #: A head's key dims without the rope part, and its value dims (the expanded form).
    nope_dim: int
    value_dim: int
    #: Softmax scale of the scores (the line's, e.g. with YaRN's mscale folded in).
    scale: float

    @property
    def flashinfer_supported(self) -> bool:
        return (self.latent_dim, self.rope_dim) in FLASHINFER_LATENT_SHAPES

    def expands(self, q_len: int, seq_len: int) -> bool:
        """Whether a chunk of `q_len` rows ending at `seq_len` costs fewer FLOPs expanded."""
        projection = 2 * self.latent_dim * (self.nope_dim + self.value_dim)
        saving = 2 * (2 * self.latent_dim + self.rope_dim) - 2 * (
            self.nope_dim + self.rope_dim + self.value_dim
        )
        prefix = seq_len - q_len
        pairs = q_len * prefix + q_len * (q_len + 1) // 2
        return prefix * projection < pairs * saving


class PagedLatentAttention(ABC):
    """The absorbed form: causal attention of a step's absorbed queries over each sequence's
    paged latents."""

    def __init__(self, shape: LatentShape) -> None:
        self.shape = shape

    @abstractmethod
    def plan(self, batch: ForwardBatch) -> None:
        """Prepare for `run` calls on `batch` (once per step, never inside a CUDA graph)."""

    @abstractmethod
    def run(
        self,
        q_latent: torch.Tensor,
        q_pe: torch.Tensor,
        ckv_layer: torch.Tensor,
        kpe_layer: torch.Tensor,
    ) -> torch.Tensor:
        """q_latent [tokens, heads, latent], q_pe [tokens, heads, rope] → out [tokens, heads,
        latent], over one layer's caches."""

    def plan_graph(self, batch: ForwardBatch, bucket: int) -> None:
        """Plan a pure-decode batch padded to `bucket` rows for a captured graph."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")


class TorchPagedLatentAttention(PagedLatentAttention):
    """The reference: per-sequence attention over gathered blocks."""

    def plan(self, batch: ForwardBatch) -> None:
        self._batch = batch

    def run(
        self,
        q_latent: torch.Tensor,
        q_pe: torch.Tensor,
        ckv_layer: torch.Tensor,
        kpe_layer: torch.Tensor,
    ) -> torch.Tensor:
        return paged_latent_attention(
            q_latent, q_pe, ckv_layer, kpe_layer, self._batch, self.shape.scale
        )


class FlashInferPagedLatentAttention(PagedLatentAttention):
    """FlashInfer's batched MLA: one plan covers the step's absorbed sequences (chunks are causal
    queries of several rows, decodes of one); each graph bucket has its own wrapper over
    slices of one set of fixed index buffers (graphs replay one at a time). The FA2 backend,
    FlashInfer's general one, unless told otherwise (`benchmarks/mla_decode.py` times FA3's
    Hopper kernels beside it)."""

    def __init__(
        self,
        shape: LatentShape,
        dtype: torch.dtype,
        device: torch.device,
        max_pages_per_seq: int,
        graph_buckets: tuple[int, ...] = (),
        backend: str = "fa2",
    ) -> None:
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        if not shape.flashinfer_supported:
            raise ValueError(f"FlashInfer's MLA kernels do not cover {shape}")
        super().__init__(shape)
        self.dtype = dtype
        self.device = device
        self.workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._eager = BatchMLAPagedAttentionWrapper(self.workspace, backend=backend)
        largest = max(graph_buckets, default=0)
        qo_indptr = torch.arange(largest + 1, dtype=torch.int32, device=device)
        kv_indptr = torch.zeros(largest + 1, dtype=torch.int32, device=device)
        kv_indices = torch.zeros(largest * max_pages_per_seq, dtype=torch.int32, device=device)
        kv_lens = torch.zeros(largest, dtype=torch.int32, device=device)
        self._graph = {
            bucket: BatchMLAPagedAttentionWrapper(
                self.workspace,
                use_cuda_graph=True,
                qo_indptr=qo_indptr[: bucket + 1],
                kv_indptr=kv_indptr[: bucket + 1],
                kv_indices=kv_indices[: bucket * max_pages_per_seq],
                kv_len_arr=kv_lens[:bucket],
                backend=backend,
            )
            for bucket in graph_buckets
        }
        # A step plans one wrapper (eager or its bucket's), all under `_staging`.
        share_plan_buffers([self._eager, *self._graph.values()])
        self._active = self._eager
        self._staging = PlanStaging()

    def _plan(self, wrapper, batch: ForwardBatch) -> None:
        index = PagedIndex.of(batch, self.device)
        s = self.shape
        with self._staging:
            wrapper.plan(
                batch.query_start_loc_cpu.pin_memory(),
                index.kv_indptr,
                index.kv_indices,
                torch.tensor(batch.seq_lens_cpu, dtype=torch.int32).pin_memory(),
                s.num_heads,
                s.latent_dim,
                s.rope_dim,
                batch.block_size,
                True,  # causal: a chunk's rows see the cache up to their own positions
                s.scale,
                self.dtype,
                self.dtype,
            )
        self._active = wrapper

    def plan(self, batch: ForwardBatch) -> None:
        self._plan(self._eager, batch)

    def plan_graph(self, batch: ForwardBatch, bucket: int) -> None:
        self._plan(self._graph[bucket], batch)

    def run(
        self,
        q_latent: torch.Tensor,
        q_pe: torch.Tensor,
        ckv_layer: torch.Tensor,
        kpe_layer: torch.Tensor,
    ) -> torch.Tensor:
        return self._active.run(q_latent, q_pe, ckv_layer, kpe_layer)


class RaggedAttention(ABC):
    """The expanded form's attention: packed queries over packed keys and values, causal per
    sequence with the last query row seeing all of the sequence's keys."""

    @abstractmethod
    def plan(self, q_lens: list[int], kv_lens: list[int]) -> None:
        """Prepare for `run` calls over sequences of these lengths (once per step)."""

    @abstractmethod
    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [rows, heads, qk], k [keys, heads, qk], v [keys, heads, value] → [rows, heads,
        value]."""


class TorchRaggedAttention(RaggedAttention):
    """The reference: per-sequence attention in float32 (`ops.latent_attention`)."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def plan(self, q_lens: list[int], kv_lens: list[int]) -> None:
        self._lens = (q_lens, kv_lens)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ragged_attention(q, k, v, *self._lens, self.scale)


class FlashInferRaggedAttention(RaggedAttention):
    """FlashInfer's ragged prefill (causal, bottom-right aligned), query/key dims apart from
    value dims."""

    def __init__(self, shape: LatentShape, dtype: torch.dtype, workspace: torch.Tensor) -> None:
        from flashinfer import BatchPrefillWithRaggedKVCacheWrapper

        self.shape = shape
        self.dtype = dtype
        self._wrapper = BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
        self._staging = PlanStaging()

    def plan(self, q_lens: list[int], kv_lens: list[int]) -> None:
        s = self.shape
        with self._staging:
            self._wrapper.plan(
                _indptr(q_lens), _indptr(kv_lens), s.num_heads, s.num_heads,
                s.nope_dim + s.rope_dim, s.value_dim, causal=True, sm_scale=s.scale,
                q_data_type=self.dtype, kv_data_type=self.dtype,
            )  # fmt: skip

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self._wrapper.run(q, k, v)


def _indptr(lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0, out=out[1:])
    return out


@dataclass
class _Split:
    """A step's sequences by form: the absorbed ones as a batch of their own (None: none), and
    in a step of both forms the rows of each (None otherwise)."""

    absorbed_batch: ForwardBatch | None
    absorbed_rows: torch.Tensor | None
    expanded_rows: torch.Tensor | None
    #: The cache slots of every token of the expanded sequences, sequence after sequence.
    expanded_slots: torch.Tensor | None


class MultiHeadLatentAttention:
    """A model's MLA: plans each step's split between the two forms, and runs both with the
    layer's up-projection `kv_b` [heads, nope + value, latent]."""

    def __init__(
        self,
        shape: LatentShape,
        absorbed: PagedLatentAttention,
        expanded: RaggedAttention,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.shape = shape
        self.absorbed = absorbed
        self.expanded = expanded
        self.dtype = dtype
        self.device = device
        self._split = _Split(None, None, None, None)
        #: Set while piecewise graphs are captured (a cut, as `PagedAttention.split`).
        self.split: Split | None = None

    @property
    def transient_bytes(self) -> int:
        """The most `run` holds for the expanded form at once: per cached token its latent
        and rope key, per token and head the up-projection, the key and the value."""
        s = self.shape
        tokens = _EXPANDED_TOKEN_HEADS // s.num_heads
        per_token = (
            s.latent_dim
            + s.rope_dim
            + s.num_heads * ((s.nope_dim + s.value_dim) + (s.nope_dim + s.rope_dim) + s.value_dim)
        )
        return tokens * per_token * self.dtype.itemsize

    def plan(self, batch: ForwardBatch) -> None:
        """Split the step's sequences between the forms and plan each (outside any graph)."""
        budget, expand = _EXPANDED_TOKEN_HEADS // self.shape.num_heads, []
        for i, (q_len, seq_len) in enumerate(
            zip(batch.query_lens_cpu, batch.seq_lens_cpu, strict=True)
        ):
            if self.shape.expands(q_len, seq_len) and seq_len <= budget:
                expand.append(i)
                budget -= seq_len
        if not expand:
            self._split = _Split(batch, None, None, None)
            self.absorbed.plan(batch)
            return
        expanding = set(expand)
        keep = [i for i in range(batch.num_seqs) if i not in expanding]
        absorbed = sub_batch(batch, keep) if keep else None
        if absorbed is not None:
            self.absorbed.plan(absorbed)
        self.expanded.plan([batch.query_lens_cpu[i] for i in expand],
                           [batch.seq_lens_cpu[i] for i in expand])  # fmt: skip
        slots = _token_slots(batch, expand)
        self._split = _Split(
            absorbed,
            self._rows(batch, keep) if keep else None,
            self._rows(batch, expand) if keep else None,
            self._to_device(slots),
        )

    def plan_graph(self, batch: ForwardBatch, bucket: int) -> None:
        """Plan a pure-decode batch padded to `bucket` rows (all absorbed) for a graph."""
        self._split = _Split(batch, None, None, None)
        self.absorbed.plan_graph(batch, bucket)

    def run(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        ckv_layer: torch.Tensor,
        kpe_layer: torch.Tensor,
        kv_b: torch.Tensor,
    ) -> torch.Tensor:
        """q_nope [tokens, heads, nope], q_pe [tokens, heads, rope] (roped), one layer's
        caches (this step's latents already written) → out [tokens, heads, value]."""
        if self.split is not None:
            return self.split(self.attend, (q_nope, q_pe), (ckv_layer, kpe_layer, kv_b))
        return self.attend(q_nope, q_pe, ckv_layer, kpe_layer, kv_b)

    def attend(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        ckv_layer: torch.Tensor,
        kpe_layer: torch.Tensor,
        kv_b: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`run`'s attention (into `out` if given)."""
        result = self._attend(q_nope, q_pe, ckv_layer, kpe_layer, kv_b)
        return result if out is None else out.copy_(result)

    def _attend(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        ckv_layer: torch.Tensor,
        kpe_layer: torch.Tensor,
        kv_b: torch.Tensor,
    ) -> torch.Tensor:
        split, nope = self._split, self.shape.nope_dim
        w_uk, w_uv = kv_b[:, :nope], kv_b[:, nope:]
        if split.expanded_slots is None:
            return self._absorbed(q_nope, q_pe, ckv_layer, kpe_layer, w_uk, w_uv)
        if split.absorbed_batch is None:
            return self._expanded(q_nope, q_pe, ckv_layer, kpe_layer, kv_b)
        tokens, heads = q_nope.shape[:2]
        out = q_nope.new_empty(tokens, heads, self.shape.value_dim)
        rows = split.absorbed_rows
        out[rows] = self._absorbed(q_nope[rows], q_pe[rows], ckv_layer, kpe_layer, w_uk, w_uv)
        rows = split.expanded_rows
        out[rows] = self._expanded(q_nope[rows], q_pe[rows], ckv_layer, kpe_layer, kv_b)
        return out

    def _absorbed(self, q_nope, q_pe, ckv_layer, kpe_layer, w_uk, w_uv) -> torch.Tensor:
        latent = self.absorbed.run(absorb_query(q_nope, w_uk), q_pe, ckv_layer, kpe_layer)
        return project_values(latent, w_uv)

    def _expanded(self, q_nope, q_pe, ckv_layer, kpe_layer, kv_b) -> torch.Tensor:
        s, slots = self.shape, self._split.expanded_slots
        c = ckv_layer.flatten(0, 1)[slots]
        k_pe = kpe_layer.flatten(0, 1)[slots]
        kv = F.linear(c, kv_b.flatten(0, 1)).view(-1, s.num_heads, s.nope_dim + s.value_dim)
        k = torch.cat((kv[..., : s.nope_dim], k_pe[:, None].expand(-1, s.num_heads, -1)), -1)
        q = torch.cat((q_nope, q_pe), dim=-1)
        return self.expanded.run(q, k, kv[..., s.nope_dim :].contiguous())

    def _rows(self, batch: ForwardBatch, seqs: list[int]) -> torch.Tensor:
        return self._to_device(sequence_rows(batch, seqs))

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """The absorbed form's queries: q_nope [tokens, heads, nope] through each head's key
    up-projection w_uk [heads, nope, latent] → [tokens, heads, latent]. Head-major
    ([heads, tokens, ...]) around the product, through strides: nothing is transposed in
    memory (attention reads that layout as it is)."""
    return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)


def project_values(latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """The absorbed form's output: latent [tokens, heads, latent] through each head's value
    up-projection w_uv [heads, value, latent] → [tokens, heads, value]."""
    return torch.bmm(latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def sequence_rows(batch: ForwardBatch, seqs: list[int]) -> torch.Tensor:
    """The rows (host, int64) of sequences `seqs` of the step, sequence after sequence."""
    starts = batch.query_start_loc_cpu.long()
    return _ranges(starts[seqs], starts[1:][seqs] - starts[seqs])


def sub_batch(batch: ForwardBatch, seqs: list[int]) -> ForwardBatch:
    """The attention metadata of some of a step's sequences (their rows renumbered), for
    planning only: its per-token tensors are still the whole step's."""
    q_lens = [batch.query_lens_cpu[i] for i in seqs]
    return dataclasses.replace(
        batch,
        query_lens_cpu=q_lens,
        seq_lens_cpu=[batch.seq_lens_cpu[i] for i in seqs],
        block_tables_cpu=[batch.block_tables_cpu[i] for i in seqs],
        query_start_loc_cpu=_indptr(q_lens),
    )


def _ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The concatenation of arange(start, start + length) for each pair (one pass, however
    many sequences a step has)."""
    offsets = lengths.cumsum(0) - lengths
    return torch.arange(int(lengths.sum())) + torch.repeat_interleave(starts - offsets, lengths)


def _token_slots(batch: ForwardBatch, seqs: list[int]) -> torch.Tensor:
    """The cache slot of every token of sequences `seqs` (positions 0.. seq_len - 1 each),
    sequence after sequence."""
    bs = batch.block_size
    lengths = torch.tensor([batch.seq_lens_cpu[i] for i in seqs])
    pages = (lengths + bs - 1) // bs
    tables = torch.tensor([block for i, n in zip(seqs, pages.tolist(), strict=True)
                           for block in batch.block_tables_cpu[i][:n]])  # fmt: skip
    positions = _ranges(torch.zeros_like(lengths), lengths)
    first_page = torch.repeat_interleave(pages.cumsum(0) - pages, lengths)
    return tables[first_page + positions // bs] * bs + positions % bs


def make_latent_attention(
    shape: LatentShape, dtype: torch.dtype, device: torch.device, runtime: RuntimeConfig
) -> MultiHeadLatentAttention:
    """FlashInfer on CUDA for the latent sizes it covers (if the step budgets fit its planner),
    the torch references otherwise."""
    if device.type == "cuda" and shape.flashinfer_supported:
        # The most rows and sequences the absorbed form plans in one step: a decode graph
        # pads to its bucket (up to max_num_seqs rows), and the KV-sizing step splits the
        # token budget into prompts of at most max_model_len.
        budget = runtime.max_num_batched_tokens
        rows = max(budget, max(runtime.graph_buckets, default=0))
        seqs = max(runtime.max_num_seqs, -(-budget // runtime.max_model_len))
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        check_mla_plan_fits(shape.num_heads, rows, seqs, sms)
        absorbed = FlashInferPagedLatentAttention(
            shape, dtype, device, runtime.max_pages_per_seq, runtime.graph_buckets
        )
        expanded: RaggedAttention = FlashInferRaggedAttention(shape, dtype, absorbed.workspace)
    else:
        absorbed, expanded = TorchPagedLatentAttention(shape), TorchRaggedAttention(shape.scale)
    return MultiHeadLatentAttention(shape, absorbed, expanded, dtype, device)
