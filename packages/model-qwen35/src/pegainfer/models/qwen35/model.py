"""Qwen3.5's forward pass: gated full attention over paged KV, Gated DeltaNet over state slots.

Three of every four layers are Gated DeltaNet (linear attention): each running sequence keeps
a conv window and a recurrent matrix per such layer in its state slot, read and written in
place every step. The rest are gated GQA attention with partial RoPE over paged KV.

Two sets of ops compute the same function. The reference (and CPU) path runs the DeltaNet one
sequence at a time with the torch ops of `ops.py`, following transformers' `Qwen3_5ForCausalLM`
op for op, casts included. On CUDA the DeltaNet layers run the whole step through the Triton
kernels of `kernels.py`, the norms and the MLP through core's fused kernels and attention
through FlashInfer between two fused kernels (`attention_kernels.py`: q/k norms, partial RoPE
and the KV write before it, the sigmoid gate after); pure-decode steps replay CUDA graphs.
Projections are fused where the GPU wants them fused: q (with its gate)/k/v in one matrix, the
DeltaNet's qkv/z/b/a in one, gate/up in one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from itertools import chain
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pegainfer.core.attention.paged import GQAShape, PagedAttention, runtime_paged_attention
from pegainfer.core.distributed import parallel
from pegainfer.core.errors import ConfigError
from pegainfer.core.kernels.dispatch import uses_cuda_kernels
from pegainfer.core.kv.kv_cache import ArenaSpec, KVCache, StateSpec
from pegainfer.core.layer_ops import LayerOps, layer_ops
from pegainfer.core.loading.weights import WeightTarget, empty_param
from pegainfer.core.model import Model
from pegainfer.core.model_line import RuntimeConfig
from pegainfer.core.ops import rms_norm
from pegainfer.core.ops.paged_attention import write_kv
from pegainfer.core.ops.rotary import RotaryEmbedding
from pegainfer.core.runner.forward_batch import ForwardBatch, to_device_array
from pegainfer.models.qwen35 import ops
from pegainfer.models.qwen35.config import FULL, Qwen35Config

if TYPE_CHECKING:
    from pegainfer.models.qwen35.kernels import ChunkPlan

#: Set to 1, decode steps (and their graphs) run each DeltaNet layer's conv, recurrent step and
#: gated norm in one launch (`kernels.decode_gated_delta_net`) instead of three. Off by default
#: until an H200 run has checked and timed it (issue 20).
FUSED_DECODE_ENV = "PEGAINFER_QWEN35_FUSED_DECODE"


def fused_decode() -> bool:
    """Whether `FUSED_DECODE_ENV` asks for the fused decode kernel (refusing other values)."""
    value = os.environ.get(FUSED_DECODE_ENV, "0")
    if value not in ("0", "1"):
        raise ConfigError(f"{FUSED_DECODE_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


# Checkpoint prefixes of the decoder: VLM checkpoints nest it under the language model.
_PREFIXES = ("model.language_model.", "model.")
_IGNORED = ("model.visual.", "mtp.")


@dataclass(frozen=True)
class DeltaNetStep:
    """How the DeltaNet kernels walk one step (CUDA path), built once per step.

    Sequence i owns rows bounds[i]:bounds[i+1] and the state slot slots[i]; the conv runs them
    all. The delta rule runs each one-token sequence through the recurrent kernel (the
    sequences in `recurrent_slots`, at rows `recurrent_rows`; None: row i is sequence i, a
    decode step) and the others through the chunk kernels (`chunks`), so the decodes of a
    mixed step cost a decode each, not a chunk each. `conv_tiles` (None in a decode step)
    cuts the rows into the conv's tiles; `conv_snapshots` (offsets, slots) says where the conv
    window is checkpointed, when anything is. `arrivals` (the fused decode kernel's zeroed
    counters) is set when a decode step runs that kernel instead (opt-in: `FUSED_DECODE_ENV`).
    """

    slots: torch.Tensor
    bounds: torch.Tensor
    max_len: int
    recurrent_slots: torch.Tensor | None = None
    recurrent_rows: torch.Tensor | None = None
    chunks: ChunkPlan | None = None
    conv_tiles: tuple[torch.Tensor, torch.Tensor] | None = None
    conv_snapshots: tuple[torch.Tensor, torch.Tensor] | None = None
    arrivals: torch.Tensor | None = None

    @classmethod
    def of(
        cls,
        batch: ForwardBatch,
        decode_bounds: torch.Tensor | None = None,
        arrivals: torch.Tensor | None = None,
    ) -> DeltaNetStep:
        from pegainfer.models.qwen35.kernels import ChunkPlan, conv_tiles

        assert batch.state_slots is not None
        num_seqs, device = batch.num_seqs, batch.input_ids.device
        snapshots = batch.state_snapshot_cpu
        if batch.is_decode and not any(snapshots):
            bounds = decode_bounds[: num_seqs + 1] if decode_bounds is not None else None
            if bounds is None:
                bounds = torch.arange(num_seqs + 1, dtype=torch.int32, device=device)
            return cls(batch.state_slots, bounds, 1, recurrent_slots=batch.state_slots,
                       arrivals=arrivals)  # fmt: skip
        bounds = batch.query_start_loc_cpu.tolist()
        slots = batch.state_slots_cpu
        # A checkpoint at offset 0 is the state the step starts from: `_start_states` copies it.
        inside = [s if s is not None and s[0] > 0 else None for s in snapshots]
        single = [n == 1 and s is None for n, s in zip(batch.query_lens_cpu, inside, strict=True)]
        recurrent = [i for i in range(num_seqs) if single[i]]
        chunked = [i for i in range(num_seqs) if not single[i]]
        plan = ChunkPlan.host_lists([(bounds[i], bounds[i + 1], inside[i]) for i in chunked])
        lists = (
            bounds,
            [bounds[i] for i in recurrent],
            [slots[i] for i in recurrent],
            [slots[i] for i in chunked],
            *plan,
            *conv_tiles(bounds),
            [-1 if s is None else s[0] for s in inside],
            [0 if s is None else s[1] for s in inside],
        )
        host = np.fromiter(chain.from_iterable(lists), np.int32, sum(map(len, lists)))
        parts = to_device_array(host, device).split([len(x) for x in lists])
        return cls(
            slots=batch.state_slots,
            bounds=parts[0],
            max_len=max(batch.query_lens_cpu),
            recurrent_slots=parts[2] if recurrent else None,
            recurrent_rows=parts[1] if recurrent else None,
            chunks=ChunkPlan(*parts[3:8]) if chunked else None,
            conv_tiles=(parts[8], parts[9]),
            conv_snapshots=(parts[10], parts[11]) if any(inside) else None,
        )


class GatedAttention(nn.Module):
    """GQA attention whose output is gated per channel by a second half of q_proj."""

    def __init__(self, cfg: Qwen35Config, group: parallel.ParallelGroup) -> None:
        super().__init__()
        self.cfg = cfg
        self.group = group
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # [q_proj (per head: query | gate) | k_proj | v_proj]
        self.qkv_proj = empty_param(2 * q_size + 2 * kv_size, cfg.hidden_size)
        self.o_proj = empty_param(cfg.hidden_size, q_size)
        self.q_norm = empty_param(cfg.head_dim)
        self.k_norm = empty_param(cfg.head_dim)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        kv_layer: torch.Tensor,
        rope: RotaryEmbedding,
        attn: PagedAttention,
    ) -> torch.Tensor:
        cfg, tokens = self.cfg, x.shape[0]
        qkv = F.linear(x, self.qkv_proj)
        if uses_cuda_kernels(qkv):  # the same function in two fused kernels around FlashInfer
            fused = _fused_attention()
            q = fused.qk_norm_rope_kv_write(
                qkv, self.q_norm, self.k_norm, rope.cos, rope.sin, batch.positions,
                batch.slot_mapping, kv_layer, cfg.num_heads, cfg.num_kv_heads, cfg.rotary_dim,
                cfg.rms_norm_eps,
            )  # fmt: skip
            out = fused.sigmoid_gate(attn.run(q, kv_layer).reshape(tokens, -1), qkv, cfg.num_heads)
            return parallel.row_parallel_linear(out, self.o_proj, self.group)
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        query_gate, k, v = qkv.split([2 * q_size, kv_size, kv_size], -1)
        query_gate = query_gate.view(tokens, cfg.num_heads, 2 * cfg.head_dim)
        q, gate = query_gate[..., : cfg.head_dim], query_gate[..., cfg.head_dim :]
        eps = cfg.rms_norm_eps
        q = rms_norm.rms_norm(q, self.q_norm, eps, zero_centred=True)
        k = k.reshape(tokens, cfg.num_kv_heads, cfg.head_dim)
        k = rms_norm.rms_norm(k, self.k_norm, eps, zero_centred=True)
        q, k = rope.apply(q, batch.positions), rope.apply(k, batch.positions)
        write_kv(kv_layer, k, v.reshape(tokens, cfg.num_kv_heads, cfg.head_dim), batch)
        out = attn.run(q.contiguous(), kv_layer).reshape(tokens, -1)
        out = out * torch.sigmoid(gate.reshape(tokens, -1))
        return parallel.row_parallel_linear(out, self.o_proj, self.group)


@cache
def _fused_attention() -> ModuleType:
    """The gated attention's CUDA kernels (imported on first use: the CPU path needs no
    Triton)."""
    from pegainfer.models.qwen35 import attention_kernels

    return attention_kernels


class GatedDeltaNet(nn.Module):
    """Linear attention with a delta-rule state, a causal conv before it and a gated norm after."""

    def __init__(self, cfg: Qwen35Config, group: parallel.ParallelGroup) -> None:
        super().__init__()
        self.cfg = cfg
        self.group = group
        heads = cfg.linear_num_value_heads
        value_dim = heads * cfg.linear_value_head_dim
        # [in_proj_qkv | in_proj_z | in_proj_b | in_proj_a]
        self.in_proj = empty_param(cfg.conv_channels + value_dim + 2 * heads, cfg.hidden_size)
        self.conv1d = empty_param(cfg.conv_channels, 1, cfg.conv_kernel)
        self.A_log = empty_param(heads)
        self.dt_bias = empty_param(heads)
        self.norm = empty_param(cfg.linear_value_head_dim)
        self.out_proj = empty_param(cfg.hidden_size, value_dim)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        conv_states: torch.Tensor,
        recurrent_states: torch.Tensor,
        step: DeltaNetStep | None,
    ) -> torch.Tensor:
        """x [T, hidden]; conv_states [slots, C, K-1] and recurrent_states [slots, Hv, dk, dv]
        are this layer's state arenas, updated in place for every sequence of the batch. With
        a `step` plan the kernels run the whole batch, else the reference ops."""
        cfg, tokens = self.cfg, x.shape[0]
        heads, dv, channels = (
            cfg.linear_num_value_heads,
            cfg.linear_value_head_dim,
            cfg.conv_channels,
        )
        proj = F.linear(x, self.in_proj)
        z = proj[:, channels : channels + heads * dv].view(tokens, heads, dv)
        if step is None:
            out = self._reference(proj, batch, conv_states, recurrent_states)
            out = ops.gated_rms_norm(out, z, self.norm, cfg.rms_norm_eps)
        else:
            out = self._kernels(proj, z, step, conv_states, recurrent_states)
        return parallel.row_parallel_linear(out.reshape(tokens, -1), self.out_proj, self.group)

    def _kernels(
        self,
        proj: torch.Tensor,
        z: torch.Tensor,
        step: DeltaNetStep,
        conv_states: torch.Tensor,
        recurrent_states: torch.Tensor,
    ) -> torch.Tensor:
        """The conv, the delta rule and the gated norm over the whole step (CUDA)."""
        from pegainfer.models.qwen35 import kernels

        cfg = self.cfg
        shape = kernels.DeltaNetShape(
            cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
            cfg.linear_value_head_dim,
        )  # fmt: skip
        if step.arrivals is not None:  # a decode step, all three in one launch (opt-in)
            return kernels.decode_gated_delta_net(
                proj, self.conv1d, conv_states, self.A_log, self.dt_bias, self.norm,
                cfg.rms_norm_eps, recurrent_states, step.slots, step.arrivals, shape,
            )  # fmt: skip
        qkv = kernels.causal_conv1d(
            proj[:, : cfg.conv_channels], self.conv1d, conv_states, step.slots, step.bounds,
            step.max_len, step.conv_tiles, step.conv_snapshots,
        )  # fmt: skip
        out = torch.empty(qkv.shape[0], *z.shape[1:], dtype=qkv.dtype, device=qkv.device)
        args = (qkv, proj, self.A_log, self.dt_bias, recurrent_states)
        if step.chunks is not None:
            kernels.chunked_gated_delta_rule(*args, step.chunks, shape, out)
        if step.recurrent_slots is not None:
            kernels.recurrent_gated_delta_rule(
                *args, step.recurrent_slots, shape, step.recurrent_rows, out
            )
        return kernels.gated_rms_norm(out, z, self.norm, cfg.rms_norm_eps)

    def _reference(
        self,
        proj: torch.Tensor,
        batch: ForwardBatch,
        conv_states: torch.Tensor,
        recurrent_states: torch.Tensor,
    ) -> torch.Tensor:
        """One sequence at a time with the torch ops, deciding recurrent or chunked per piece
        as transformers does."""
        cfg, tokens = self.cfg, proj.shape[0]
        heads, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        mixed = proj[:, : cfg.conv_channels]
        b, a = proj[:, -2 * heads : -heads], proj[:, -heads:]
        beta = b.sigmoid()
        decay = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out = torch.empty(tokens, heads, dv, dtype=proj.dtype, device=proj.device)
        bounds = batch.query_start_loc_cpu.tolist()
        for i, slot in enumerate(batch.state_slots_cpu):
            start, end = bounds[i], bounds[i + 1]
            pieces = [(start, end, None)]
            snapshot = batch.state_snapshot_cpu[i]
            # Checkpoint the state after `offset` tokens (offset 0: `_start_states` did).
            if snapshot is not None and snapshot[0] > 0:
                offset, checkpoint = snapshot
                pieces = [(start, start + offset, checkpoint), (start + offset, end, None)]
            first_position = batch.seq_lens_cpu[i] - (end - start)
            for lo, hi, checkpoint in pieces:
                if hi > lo:
                    # transformers scans one token after a state recurrently, else in chunks.
                    recurrent = hi - lo == 1 and first_position + lo - start > 0
                    out[lo:hi] = self._scan(
                        mixed[lo:hi], decay[lo:hi], beta[lo:hi], conv_states, recurrent_states,
                        slot, recurrent,
                    )  # fmt: skip
                if checkpoint is not None:
                    conv_states[checkpoint] = conv_states[slot]
                    recurrent_states[checkpoint] = recurrent_states[slot]
        return out

    def _scan(
        self,
        mixed: torch.Tensor,
        decay: torch.Tensor,
        beta: torch.Tensor,
        conv_states: torch.Tensor,
        recurrent_states: torch.Tensor,
        slot: int,
        recurrent: bool,
    ) -> torch.Tensor:
        """Conv then the delta rule over one sequence's tokens, from and into its slot."""
        cfg, n = self.cfg, mixed.shape[0]
        heads, dk, dv = (
            cfg.linear_num_value_heads,
            cfg.linear_key_head_dim,
            cfg.linear_value_head_dim,
        )
        key_dim = cfg.linear_num_key_heads * dk
        group = heads // cfg.linear_num_key_heads
        conv_out, conv_states[slot] = ops.causal_conv1d(mixed, self.conv1d[:, 0], conv_states[slot])
        q, k, v = conv_out.split([key_dim, key_dim, conv_out.shape[1] - 2 * key_dim], dim=-1)
        q = ops.l2_normalize(q.float().view(n, -1, dk)).repeat_interleave(group, dim=1)
        k = ops.l2_normalize(k.float().view(n, -1, dk)).repeat_interleave(group, dim=1)
        rule = ops.recurrent_gated_delta_rule if recurrent else ops.chunked_gated_delta_rule
        o, recurrent_states[slot] = rule(
            q * dk**-0.5, k, v.float().view(n, heads, dv), decay, beta.float(),
            recurrent_states[slot],
        )  # fmt: skip
        return o.to(mixed.dtype)


class Qwen35Layer(nn.Module):
    def __init__(self, cfg: Qwen35Config, kind: str, group: parallel.ParallelGroup) -> None:
        super().__init__()
        self.kind = kind
        self.group = group
        if kind == FULL:
            self.self_attn = GatedAttention(cfg, group)
        else:
            self.linear_attn = GatedDeltaNet(cfg, group)
        self.input_layernorm = empty_param(cfg.hidden_size)
        self.post_attention_layernorm = empty_param(cfg.hidden_size)
        self.gate_up_proj = empty_param(2 * cfg.intermediate_size, cfg.hidden_size)
        self.down_proj = empty_param(cfg.hidden_size, cfg.intermediate_size)

    def mlp(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        h = ops.silu_and_mul(F.linear(x, self.gate_up_proj))
        return parallel.row_parallel_linear(h, self.down_proj, self.group)


class Qwen35ForCausalLM(Model):
    supports_cuda_graphs = True
    gqa_decode_kernels = True

    def __init__(self, cfg: Qwen35Config, group: parallel.ParallelGroup | None = None) -> None:
        super().__init__()
        self.group = group = group or parallel.ParallelGroup()
        self.full_cfg = cfg
        split = ("num_heads", "num_kv_heads", "linear_num_key_heads", "linear_num_value_heads",
                 "intermediate_size")  # fmt: skip
        self.cfg = cfg = parallel.shard_config(cfg, group, split, vocab_size=cfg.vocab_size)
        vocab_rows = cfg.vocab_size // group.world_size
        self.embed_tokens = empty_param(vocab_rows, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen35Layer(cfg, kind, group) for kind in cfg.layer_types)
        self.norm = empty_param(cfg.hidden_size)
        self.lm_head = None if cfg.tie_word_embeddings else empty_param(vocab_rows, cfg.hidden_size)
        # Where each layer's cache lives: its index among the full or the linear layers.
        self._cache_index = {i: n for layers in (cfg.full_layers, cfg.linear_layers)
                             for n, i in enumerate(layers)}  # fmt: skip
        self.rope: RotaryEmbedding | None = None
        self.attn: PagedAttention | None = None
        self.ops: LayerOps | None = None
        self._decode_bounds: torch.Tensor | None = None
        # The fused decode kernel's counters, when decode steps run it (`FUSED_DECODE_ENV`).
        self._arrivals: torch.Tensor | None = None
        # The step `prepare`/`prepare_graph` planned: the DeltaNet kernels' walk (CUDA), and
        # whether it replays a graph (states then only continue: nothing to start).
        self._step: DeltaNetStep | None = None
        self._replaying = False
        # Speculative decoding with the MTP layer: its module, and every row's final hidden
        # state of the last forward (a fixed buffer, so graph replays fill it too).
        self.mtp: nn.Module | None = None
        self._max_rows = 0
        self._final_hidden: torch.Tensor | None = None

    @property
    def vocab_size(self) -> int:
        return self.full_cfg.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return self.cfg.max_position_embeddings

    def kv_arenas(self, block_size: int) -> list[ArenaSpec]:
        cfg = self.cfg
        block = (2, block_size, cfg.num_kv_heads, cfg.head_dim)
        arenas = [ArenaSpec("kv", len(cfg.full_layers), block, self.embed_tokens.dtype)]
        if self.mtp is not None:
            arenas.append(ArenaSpec("mtp_kv", 1, block, self.embed_tokens.dtype))
        return arenas

    def state_arenas(self) -> list[StateSpec]:
        cfg, layers = self.cfg, len(self.cfg.linear_layers)
        recurrent = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        return [
            StateSpec("conv", layers, (cfg.conv_channels, cfg.conv_kernel - 1), torch.float32),
            StateSpec("recurrent", layers, recurrent, torch.float32),
        ]

    @property
    def attention_shape(self) -> GQAShape:
        return GQAShape(self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim)

    def init_runtime(self, runtime: RuntimeConfig) -> None:
        device, dtype = self.embed_tokens.device, self.embed_tokens.dtype
        attn = runtime_paged_attention(self.attention_shape, dtype, device, runtime)
        self.set_up_steps(runtime, attn, device)

    def set_up_steps(
        self, runtime: RuntimeConfig, attn: PagedAttention, kernels: torch.device
    ) -> None:
        """Rotary tables and graph buffers (on the model's device), `attn`, and the ops of the
        `kernels` device type (CUDA's on a meta model: `kernel_plan`)."""
        cfg, device = self.cfg, self.embed_tokens.device
        if kernels.type == "cuda" and cfg.conv_kernel != 4:
            raise ConfigError(f"the CUDA conv kernel takes width 4, not {cfg.conv_kernel}")
        self.rope = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, runtime.max_model_len, device)
        self.attn = attn
        self.ops = layer_ops(kernels)
        self._max_rows = max(runtime.max_num_batched_tokens, *runtime.graph_buckets, 1)
        if runtime.graph_buckets:
            largest = max(runtime.graph_buckets)
            self._decode_bounds = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self._arrivals = None
        if kernels.type == "cuda" and fused_decode():
            seqs = max((runtime.max_num_seqs, *runtime.graph_buckets))
            self._arrivals = torch.zeros(seqs, cfg.linear_num_key_heads, dtype=torch.int32,
                                         device=device)  # fmt: skip

    def attach_mtp(self, mtp: nn.Module) -> None:
        """Serve speculative decoding with `mtp` (after `init_runtime`): its KV arena joins the
        model's, and each forward keeps every row's final hidden state for it."""
        self.mtp = mtp
        self._final_hidden = torch.empty(self._max_rows, self.cfg.hidden_size,
                                         dtype=self.embed_tokens.dtype,
                                         device=self.embed_tokens.device)  # fmt: skip

    def final_hidden_states(self) -> torch.Tensor:
        """Every row's hidden state after the final norm, of the last forward (with MTP), in
        the rows of a buffer as long as the longest step (a graph replay fills it without
        running any Python: nothing here knows how many rows the last step had)."""
        assert self._final_hidden is not None, "attach_mtp() keeps the final hidden states"
        return self._final_hidden

    def prepare(self, batch: ForwardBatch) -> None:
        assert self.attn is not None, "init_runtime() must run before the first step"
        self.attn.plan(batch)
        cuda = uses_cuda_kernels(batch.input_ids)
        self._step = DeltaNetStep.of(batch, self._decode_bounds, self._arrivals) if cuda else None
        self._replaying = False

    def prepare_graph(self, batch: ForwardBatch, bucket: int) -> None:
        assert self.attn is not None, "init_runtime() must run before the first step"
        self.attn.plan_graph(batch, bucket)
        self._step = DeltaNetStep.of(batch, self._decode_bounds, self._arrivals)
        self._replaying = True

    @staticmethod
    def _start_states(batch: ForwardBatch, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Every layer's state of a sequence starting at position 0 is zero; one resuming from a
        prefix hit starts from its checkpoint; a checkpoint at offset 0 of a chunk is taken
        here. Done for the whole batch before any layer runs, so a checkpoint this step
        overwrites is read first."""
        fresh, restore_to, restore_from, snap_to, snap_from = [], [], [], [], []
        for i, slot in enumerate(batch.state_slots_cpu):
            if batch.seq_lens_cpu[i] == batch.query_lens_cpu[i]:
                fresh.append(slot)
            elif (source := batch.state_restore_cpu[i]) is not None:
                restore_to.append(slot)
                restore_from.append(source)
            if (snapshot := batch.state_snapshot_cpu[i]) is not None and snapshot[0] == 0:
                snap_to.append(snapshot[1])
                snap_from.append(slot)
        lists = (fresh, restore_to, restore_from, snap_to, snap_from)
        if not any(lists):
            return
        # One asynchronous copy of the slot numbers: indexing with Python lists would copy
        # each list to the device and wait for it, stalling the launch path every step.
        host = np.fromiter(chain.from_iterable(lists), np.int64, sum(map(len, lists)))
        zero, to, source, snap, snap_source = to_device_array(host, conv.device).split(
            [len(x) for x in lists]
        )
        for arena in (conv, recurrent):
            if fresh:
                arena.index_fill_(1, zero, 0)
            if restore_to:
                arena.index_copy_(1, to, arena.index_select(1, source))
            if snap_to:
                arena.index_copy_(1, snap, arena.index_select(1, snap_source))

    def checkpoint_name_map(self, name: str) -> WeightTarget | list[WeightTarget] | None:
        """Map a Hugging Face checkpoint tensor name to our (fused) parameters, and to the
        rows or columns of it this rank keeps (None: not ours)."""
        if name.startswith(_IGNORED):
            return None
        cfg, rank = self.cfg, self.group.rank

        def mine(size: int, start: int = 0) -> tuple[int, int]:
            """This rank's part of a dimension split in rank-sized pieces after `start`."""
            return start + rank * size, start + (rank + 1) * size

        vocab = mine(self.embed_tokens.shape[0])
        if name == "lm_head.weight":
            return None if cfg.tie_word_embeddings else WeightTarget("lm_head", rows=vocab)
        prefix = next((p for p in _PREFIXES if name.startswith(p)), None)
        if prefix is None:
            return WeightTarget(name)  # unknown: the loader reports it
        path = name.removeprefix(prefix).removesuffix(".weight")
        module, _, leaf = path.rpartition(".")
        layer = module.rsplit(".", 1)[0]
        q, kv = 2 * cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        key = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        heads = cfg.linear_num_value_heads
        value, inter = heads * cfg.linear_value_head_dim, cfg.intermediate_size
        full_key = key * self.group.world_size  # where the checkpoint's k and v channels start
        channels = cfg.conv_channels
        fused = {
            "q_proj": (f"{module}.qkv_proj", 0, q, mine(q)),
            "k_proj": (f"{module}.qkv_proj", q, kv, mine(kv)),
            "v_proj": (f"{module}.qkv_proj", q + kv, kv, mine(kv)),
            "in_proj_z": (f"{module}.in_proj", channels, value, mine(value)),
            "in_proj_b": (f"{module}.in_proj", channels + value, heads, mine(heads)),
            "in_proj_a": (f"{module}.in_proj", channels + value + heads, heads, mine(heads)),
            "gate_proj": (f"{layer}.gate_up_proj", 0, inter, mine(inter)),
            "up_proj": (f"{layer}.gate_up_proj", inter, inter, mine(inter)),
        }
        if leaf in fused:
            param, offset, rows, part = fused[leaf]
            return WeightTarget(param, offset, rows, rows=part)
        if leaf in ("in_proj_qkv", "conv1d"):  # [q | k | v] channels, each split by heads
            param = f"{module}.{'in_proj' if leaf == 'in_proj_qkv' else 'conv1d'}"
            return [
                WeightTarget(param, 0, key, rows=mine(key)),
                WeightTarget(param, key, key, rows=mine(key, full_key)),
                WeightTarget(param, 2 * key, value, rows=mine(value, 2 * full_key)),
            ]
        cols = {"o_proj": q // 2, "out_proj": value, "down_proj": inter}
        if leaf in cols:
            return WeightTarget(f"{layer}.down_proj" if leaf == "down_proj" else path,
                                cols=mine(cols[leaf]))  # fmt: skip
        if leaf in ("A_log", "dt_bias"):
            return WeightTarget(path, rows=mine(heads))
        return WeightTarget(path, rows=vocab if path == "embed_tokens" else None)

    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        rope, attn, ops_, cfg = self.rope, self.attn, self.ops, self.cfg
        assert rope is not None and attn is not None and ops_ is not None
        assert len(batch.state_slots_cpu) == batch.num_seqs, (
            "Qwen3.5 steps need a state slot per sequence"
        )
        kv, conv, recurrent = kv_cache["kv"], kv_cache["conv"], kv_cache["recurrent"]
        if not self._replaying:
            self._start_states(batch, conv, recurrent)
        eps = cfg.rms_norm_eps
        hidden = parallel.vocab_parallel_embedding(batch.input_ids, self.embed_tokens, self.group)
        residual = None
        for index, layer in enumerate(self.layers):
            x, residual = ops_.add_rms_norm(hidden, residual, layer.input_layernorm, eps, True)
            n = self._cache_index[index]
            if layer.kind == FULL:
                hidden = layer.self_attn(x, batch, kv[n], rope, attn)
            else:
                hidden = layer.linear_attn(x, batch, conv[n], recurrent[n], self._step)
            x, residual = ops_.add_rms_norm(
                hidden, residual, layer.post_attention_layernorm, eps, True
            )
            hidden = layer.mlp(x, ops_)
        rows = batch.logits_indices
        # Logits rows are ascending: as many as the step's rows is every row (a decode step),
        # which needs no gather (two launches a step).
        every_row = rows.shape[0] == hidden.shape[0]
        if self._final_hidden is not None:  # the MTP drafter reads every row's
            x, _ = ops_.add_rms_norm(hidden, residual, self.norm, eps, True)
            self._final_hidden[: x.shape[0]].copy_(x)
            x = x if every_row else x[rows]
        elif every_row:
            x, _ = ops_.add_rms_norm(hidden, residual, self.norm, eps, True)
        else:  # only the rows that sample go through the final norm and the LM head
            x, _ = ops_.add_rms_norm(hidden[rows], residual[rows], self.norm, eps, True)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return parallel.vocab_parallel_logits(x, head, self.group).float()
