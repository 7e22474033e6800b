"""Qwen3.5's forward pass: gated full attention over paged KV, Gated DeltaNet over state slots.

Three of every four layers are Gated DeltaNet (linear attention): each running sequence keeps
a conv window and a recurrent matrix per such layer in its state slot, read and written in
place every step. The rest are gated GQA attention with partial RoPE over paged KV. This is
the torch reference path, one sequence at a time in the DeltaNet layers, following
transformers' `Qwen3_5ForCausalLM` op for op, casts included.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pegainfer.core.attention import GQAShape, PagedAttention, make_paged_attention
from pegainfer.core.forward_batch import ForwardBatch
from pegainfer.core.kv_cache import ArenaSpec, KVCache, StateSpec
from pegainfer.core.model_line import Model, RuntimeConfig
from pegainfer.core.ops.activation import silu_and_mul
from pegainfer.core.ops.paged_attention import write_kv
from pegainfer.core.ops.rotary import RotaryEmbedding
from pegainfer.core.weights import WeightTarget
from pegainfer.models.qwen35 import ops
from pegainfer.models.qwen35.config import FULL, Qwen35Config

# Checkpoint prefixes of the decoder: VLM checkpoints nest it under the language model.
_PREFIXES = ("model.language_model.", "model.")
_IGNORED = ("model.visual.", "mtp.")


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class GatedAttention(nn.Module):
    """GQA attention whose output is gated per channel by a second half of q_proj."""

    def __init__(self, cfg: Qwen35Config) -> None:
        super().__init__()
        self.cfg = cfg
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = _param(2 * q_size, cfg.hidden_size)  # per head: [query | gate]
        self.k_proj = _param(kv_size, cfg.hidden_size)
        self.v_proj = _param(kv_size, cfg.hidden_size)
        self.o_proj = _param(cfg.hidden_size, q_size)
        self.q_norm = _param(cfg.head_dim)
        self.k_norm = _param(cfg.head_dim)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        kv_layer: torch.Tensor,
        rope: RotaryEmbedding,
        attn: PagedAttention,
    ) -> torch.Tensor:
        cfg, tokens = self.cfg, x.shape[0]
        query_gate = F.linear(x, self.q_proj).view(tokens, cfg.num_heads, 2 * cfg.head_dim)
        q, gate = query_gate[..., : cfg.head_dim], query_gate[..., cfg.head_dim :]
        q = ops.rms_norm_offset(q, self.q_norm, cfg.rms_norm_eps)
        k = F.linear(x, self.k_proj).view(tokens, cfg.num_kv_heads, cfg.head_dim)
        k = ops.rms_norm_offset(k, self.k_norm, cfg.rms_norm_eps)
        v = F.linear(x, self.v_proj).view(tokens, cfg.num_kv_heads, cfg.head_dim)
        q, k = rope.apply(q, batch.positions), rope.apply(k, batch.positions)
        write_kv(kv_layer, k, v, batch)
        out = attn.run(q, kv_layer).reshape(tokens, -1)
        out = out * torch.sigmoid(gate.reshape(tokens, -1))
        return F.linear(out, self.o_proj)


class GatedDeltaNet(nn.Module):
    """Linear attention with a delta-rule state, a causal conv before it and a gated norm after."""

    def __init__(self, cfg: Qwen35Config) -> None:
        super().__init__()
        self.cfg = cfg
        value_dim = cfg.linear_num_value_heads * cfg.linear_value_head_dim
        self.in_proj_qkv = _param(cfg.conv_channels, cfg.hidden_size)
        self.in_proj_z = _param(value_dim, cfg.hidden_size)
        self.in_proj_b = _param(cfg.linear_num_value_heads, cfg.hidden_size)
        self.in_proj_a = _param(cfg.linear_num_value_heads, cfg.hidden_size)
        self.conv1d = _param(cfg.conv_channels, 1, cfg.conv_kernel)
        self.A_log = _param(cfg.linear_num_value_heads)
        self.dt_bias = _param(cfg.linear_num_value_heads)
        self.norm = _param(cfg.linear_value_head_dim)
        self.out_proj = _param(cfg.hidden_size, value_dim)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        conv_states: torch.Tensor,
        recurrent_states: torch.Tensor,
    ) -> torch.Tensor:
        """x [T, hidden]; conv_states [slots, C, K-1] and recurrent_states [slots, Hv, dk, dv]
        are this layer's state arenas, updated in place for every sequence of the batch."""
        cfg, tokens = self.cfg, x.shape[0]
        heads, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        mixed = F.linear(x, self.in_proj_qkv)
        z = F.linear(x, self.in_proj_z).view(tokens, heads, dv)
        beta = F.linear(x, self.in_proj_b).sigmoid()
        decay = -self.A_log.float().exp() * F.softplus(
            F.linear(x, self.in_proj_a).float() + self.dt_bias
        )
        out = torch.empty(tokens, heads, dv, dtype=x.dtype, device=x.device)
        bounds = batch.query_start_loc_cpu.tolist()
        for i, slot in enumerate(batch.state_slots_cpu):
            start, end = bounds[i], bounds[i + 1]
            pieces = [(start, end, None)]
            snapshot = batch.state_snapshot_cpu[i]
            if snapshot is not None:  # checkpoint the state after `offset` tokens
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
        out = ops.gated_rms_norm(out, z, self.norm, cfg.rms_norm_eps)
        return F.linear(out.reshape(tokens, -1), self.out_proj)

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
    def __init__(self, cfg: Qwen35Config, kind: str) -> None:
        super().__init__()
        self.kind = kind
        if kind == FULL:
            self.self_attn = GatedAttention(cfg)
        else:
            self.linear_attn = GatedDeltaNet(cfg)
        self.input_layernorm = _param(cfg.hidden_size)
        self.post_attention_layernorm = _param(cfg.hidden_size)
        self.gate_up_proj = _param(2 * cfg.intermediate_size, cfg.hidden_size)
        self.down_proj = _param(cfg.hidden_size, cfg.intermediate_size)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(silu_and_mul(F.linear(x, self.gate_up_proj)), self.down_proj)


class Qwen35ForCausalLM(Model):
    def __init__(self, cfg: Qwen35Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen35Layer(cfg, kind) for kind in cfg.layer_types)
        self.norm = _param(cfg.hidden_size)
        self.lm_head = None if cfg.tie_word_embeddings else _param(cfg.vocab_size, cfg.hidden_size)
        # Where each layer's cache lives: its index among the full or the linear layers.
        self._cache_index = {i: n for layers in (cfg.full_layers, cfg.linear_layers)
                             for n, i in enumerate(layers)}  # fmt: skip
        self.rope: RotaryEmbedding | None = None
        self.attn: PagedAttention | None = None

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return self.cfg.max_position_embeddings

    def kv_arenas(self, block_size: int) -> list[ArenaSpec]:
        cfg = self.cfg
        block = (2, block_size, cfg.num_kv_heads, cfg.head_dim)
        return [ArenaSpec("kv", len(cfg.full_layers), block, self.embed_tokens.dtype)]

    def state_arenas(self) -> list[StateSpec]:
        cfg, layers = self.cfg, len(self.cfg.linear_layers)
        recurrent = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        return [
            StateSpec("conv", layers, (cfg.conv_channels, cfg.conv_kernel - 1), torch.float32),
            StateSpec("recurrent", layers, recurrent, torch.float32),
        ]

    def init_runtime(self, runtime: RuntimeConfig) -> None:
        cfg = self.cfg
        device, dtype = self.embed_tokens.device, self.embed_tokens.dtype
        self.rope = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, runtime.max_model_len, device)
        shape = GQAShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.attn = make_paged_attention(shape, dtype, device, runtime.max_pages_per_seq)

    def prepare(self, batch: ForwardBatch) -> None:
        assert self.attn is not None, "init_runtime() must run before the first step"
        self.attn.plan(batch)

    @staticmethod
    def _start_states(batch: ForwardBatch, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Every layer's state of a sequence starting at position 0 is zero; one resuming from a
        prefix hit starts from its checkpoint. Done for the whole batch before any layer runs,
        so a checkpoint this step overwrites is read first."""
        for i, slot in enumerate(batch.state_slots_cpu):
            if batch.seq_lens_cpu[i] == batch.query_lens_cpu[i]:
                conv[:, slot].zero_()
                recurrent[:, slot].zero_()
            elif (source := batch.state_restore_cpu[i]) is not None:
                conv[:, slot] = conv[:, source]
                recurrent[:, slot] = recurrent[:, source]

    def checkpoint_name_map(self, name: str) -> WeightTarget | None:
        """Map a Hugging Face checkpoint tensor name to our parameter (None: not ours)."""
        if name.startswith(_IGNORED):
            return None
        if name == "lm_head.weight":
            return None if self.cfg.tie_word_embeddings else WeightTarget("lm_head")
        prefix = next((p for p in _PREFIXES if name.startswith(p)), None)
        if prefix is None:
            return WeightTarget(name)  # unknown: the loader reports it
        path = name.removeprefix(prefix).removesuffix(".weight")
        if path.endswith(("mlp.gate_proj", "mlp.up_proj")):
            layer = path.rsplit(".", 2)[0]
            inter = self.cfg.intermediate_size
            offset = 0 if path.endswith("gate_proj") else inter
            return WeightTarget(f"{layer}.gate_up_proj", offset, inter)
        return WeightTarget(path.replace("mlp.down_proj", "down_proj"))

    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        rope, attn, cfg = self.rope, self.attn, self.cfg
        assert rope is not None and attn is not None
        assert len(batch.state_slots_cpu) == batch.num_seqs, (
            "Qwen3.5 steps need a state slot per sequence"
        )
        kv, conv, recurrent = kv_cache["kv"], kv_cache["conv"], kv_cache["recurrent"]
        self._start_states(batch, conv, recurrent)
        eps = cfg.rms_norm_eps
        hidden = F.embedding(batch.input_ids, self.embed_tokens)
        for index, layer in enumerate(self.layers):
            x = ops.rms_norm_offset(hidden, layer.input_layernorm, eps)
            n = self._cache_index[index]
            if layer.kind == FULL:
                mixed = layer.self_attn(x, batch, kv[n], rope, attn)
            else:
                mixed = layer.linear_attn(x, batch, conv[n], recurrent[n])
            hidden = hidden + mixed
            hidden = hidden + layer.mlp(
                ops.rms_norm_offset(hidden, layer.post_attention_layernorm, eps)
            )
        x = ops.rms_norm_offset(hidden[batch.logits_indices], self.norm, eps)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(x, head).float()
