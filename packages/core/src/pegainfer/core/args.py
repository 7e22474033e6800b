"""Engine arguments: one typed struct shared by the CLI and the Python API.

Each field carries its help text, so the CLI is generated from this struct and the two can
never disagree. `validate` checks what can be checked without the model; `EngineConfig`
(see `engine.py`) resolves what needs the model's config.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from pegainfer.core.errors import ConfigError
from pegainfer.core.kv.kv_events import KVEventsConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")
SPECULATIVE_METHODS = ("mtp", "self")
DECODE_TENSOR_CORE_MODES = ("auto", "always", "never")
#: `--decode-attention-tensor-cores auto`'s batch threshold (why: `attention.paged.DecodeKernels`).
DECODE_TENSOR_CORES_FROM = 1
#: The most draft tokens per request and step (--speculative-tokens).
MAX_SPECULATIVE_TOKENS = 8


def parse_speculative_config(text: str) -> tuple[str, int]:
    """(method, number of draft tokens) from vLLM's `--speculative-config` JSON. vLLM's
    model-specific MTP methods (`deepseek_mtp`, `glm4_moe_mtp`, `qwen3_5_mtp`, ...) are each
    line's one MTP drafter; vLLM's other methods and keys are refused by name."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--speculative-config is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ConfigError("--speculative-config must be a JSON object")
    unknown = sorted(set(config) - {"method", "num_speculative_tokens"})
    if unknown:
        raise ConfigError(
            f"--speculative-config: {', '.join(map(repr, unknown))} not supported (pegainfer "
            "reads method and num_speculative_tokens)"
        )
    method = config.get("method", "mtp")
    if not isinstance(method, str):
        raise ConfigError(f"--speculative-config: method must be a string, got {method!r}")
    if method.endswith("_mtp"):
        method = "mtp"
    if method not in SPECULATIVE_METHODS:
        raise ConfigError(
            f"--speculative-config: method {method!r} is not supported: pegainfer drafts with "
            "the checkpoint's MTP layers (mtp, or vLLM's names for them such as deepseek_mtp) "
            "or, for measurements, with the model itself (self)"
        )
    tokens = config.get("num_speculative_tokens", 1)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ConfigError(
            f"--speculative-config: num_speculative_tokens must be a positive integer, "
            f"got {tokens!r}"
        )
    return method, tokens


def _arg(default: Any, help: str, flag: str | None = None) -> Any:
    """A field with its CLI help; `flag` overrides the CLI flag's name (e.g. `--no-...`)."""
    return field(default=default, metadata={"help": help, "flag": flag})


@dataclass(kw_only=True)
class EngineArgs:
    """Everything that shapes how the engine loads and serves one model."""

    model: str = field(
        metadata={
            "help": "Checkpoint directory or Hugging Face repo id (config.json inside).",
            "flag": "--model-path",
        }
    )
    tokenizer: str | None = _arg(None, "Tokenizer directory; defaults to the model's.")
    revision: str | None = _arg(None, "Hub revision (branch, tag or commit) of a repo id.")
    dtype: str = _arg(
        "auto",
        "Weight and activation dtype: auto (the checkpoint's on CUDA, float32 on the CPU), "
        "float32, bfloat16 or float16.",
    )
    device: str = _arg("auto", "cuda, cuda:N or cpu; auto takes cuda when available.")
    max_model_len: int | None = _arg(
        None, "Longest sequence (prompt + output) served; defaults to the model's maximum."
    )
    max_num_seqs: int = _arg(
        256, "Most sequences in one engine step (per attention rank with --data-parallel-size)."
    )
    max_num_batched_tokens: int = _arg(
        2048,
        "Token budget of one engine step (per attention rank with --data-parallel-size); longer "
        "prompts are prefilled in chunks.",
    )
    block_size: int = _arg(16, "Tokens per KV-cache block.")
    num_kv_blocks: int | None = _arg(
        None, "Number of KV-cache blocks; by default sized from free memory."
    )
    gpu_memory_utilization: float = _arg(
        0.90, "Fraction of GPU memory the engine may use for weights, activations and KV cache."
    )
    kv_cache_memory_bytes: int | None = _arg(
        None,
        "The KV cache's size in bytes (with the recurrent state of lines that keep one), as "
        "vLLM's flag: on a GPU instead of what gpu_memory_utilization leaves, with no "
        "profiling step at start; on the CPU instead of --cpu-kv-cache-gib.",
    )
    cpu_kv_cache_gib: float | None = _arg(
        None,
        "On the CPU, the memory (GiB) of the KV cache when not sized by blocks; by default as "
        "much as the weights take, at least 1/16 and at most 2 GiB (never more than "
        "max_num_seqs sequences of max_model_len need).",
    )
    enable_prefix_caching: bool = _arg(
        True, "Do not reuse the KV blocks of earlier prompts' prefixes.", "--no-prefix-cache"
    )
    kv_offload: bool = _arg(
        False,
        "Keep sealed KV blocks in a host-memory tier too, so prefixes that left the GPU come "
        "back by copy instead of by recomputing.",
        "--kv-offload",
    )
    kv_offload_gib: float = _arg(
        16.0, "With --kv-offload: host memory (GiB, pinned, allocated up front) for the tier."
    )
    state_checkpoints: int = _arg(
        32,
        "Models with recurrent layers: states kept at prompt boundaries for prefix-cache hits "
        "(each as large as one sequence's state; 0 turns prefix caching off for them).",
    )
    enable_chunked_prefill: bool = _arg(
        True,
        "Do not split prompts longer than the step's token budget over several steps.",
        "--no-chunked-prefill",
    )
    enforce_eager: bool = _arg(
        False, "Run every step eagerly instead of replaying CUDA graphs.", "--enforce-eager"
    )
    mixed_step_graphs: bool = _arg(
        True,
        "Run steps that carry prefill tokens eagerly instead of replaying piecewise CUDA graphs "
        "(captured per token-count bucket, attention run between the pieces).",
        "--no-mixed-step-graphs",
    )
    max_mixed_graph_tokens: int | None = _arg(
        None,
        "The largest step (in tokens) that replays piecewise CUDA graphs; larger steps run "
        "eagerly. By default where a step stops being launch-bound: the token count whose "
        "matmuls take ~30 ms at 400 TFLOP/s (about 1,536 for Qwen3-4B), within "
        "--max-num-batched-tokens.",
    )
    decode_attention_tensor_cores: str = _arg(
        "auto",
        "GQA lines on CUDA (Qwen3, Qwen3.5): which of FlashInfer's decode kernels a batch of "
        "decodes runs. always: the tensor-core kernel; never: the CUDA-core kernel (GQA groups "
        f"of 1, 2, 3, 4 or 8 only); auto: tensor cores from {DECODE_TENSOR_CORES_FROM} "
        "sequence(s) on for groups of 4 and 8, the CUDA-core kernel below that and for smaller "
        "groups.",
    )
    small_batch_gemv: bool = _arg(
        False,
        "Qwen3 on CUDA: in steps of at most 16 rows (the small decode buckets) the LM head and "
        "each MLP's gate_up, its SiLU-and-mul in the epilogue, run a Triton GEMV instead of "
        "cuBLAS (faster on an H200 at Qwen3-4B's shapes: benchmarks/decode_kernels.py).",
        "--small-batch-gemv",
    )
    async_scheduling: bool = _arg(
        True,
        "Wait for each step's tokens before scheduling the next, instead of scheduling and "
        "launching it while the step before runs on the GPU (async scheduling overlaps the "
        "host's work with the GPU's; a request that stops costs it one wasted row).",
        "--no-async-scheduling",
    )
    tensor_parallel_size: int = _arg(
        1,
        "Processes (one per device) that each hold a share of the model's heads, MLP width and "
        "vocabulary: GPUs 0..N-1 of those visible (NCCL), or CPU processes (gloo).",
    )
    enable_expert_parallel: bool = _arg(
        False,
        "MoE lines with more than one rank: divide the routed experts between the ranks (each "
        "holds whole experts) instead of splitting every expert's width across them.",
        "--enable-expert-parallel",
    )
    data_parallel_size: int = _arg(
        1,
        "MoE lines, with --enable-expert-parallel: attention ranks (one process per device) "
        "that each serve their own requests from their own KV cache, holding every weight but "
        "the routed experts, which are divided between them; each MoE layer sends tokens to "
        "their experts' ranks and back (all-to-all).",
    )
    nnodes: int = _arg(
        1,
        "Hosts the ranks (--tensor-parallel-size x --data-parallel-size) are spread over, an "
        "equal number on each: start pegainfer-server with the same flags on every host, each "
        "with its --node-rank. Node 0 serves HTTP and hosts the rendezvous at --master-addr:"
        "--master-port; the others run workers only. Default: torchrun's GROUP_WORLD_SIZE when "
        "set, else 1.",
    )
    node_rank: int | None = _arg(
        None, "This host's place among --nnodes hosts (default: torchrun's GROUP_RANK, else 0)."
    )
    master_addr: str | None = _arg(
        None,
        "With --nnodes > 1: node 0's address, which every host reaches (default: MASTER_ADDR).",
    )
    master_port: int | None = _arg(
        None,
        "With --nnodes > 1: the rendezvous port on node 0 (default: MASTER_PORT, else 29500).",
    )
    rendezvous_timeout: float = _arg(
        600.0,
        "With --nnodes > 1: seconds a host waits for the others to reach the rendezvous "
        "(node 0 for each host's ranks to connect, the others for node 0 to listen). Once "
        "connected, a rank may load for as long as it takes.",
    )
    peer_timeout: float = _arg(
        30.0,
        "With --nnodes > 1: seconds after which a host that stopped answering (power, network; "
        "a process that dies is seen at once) counts as gone: rank 0 then fails the engine and "
        "that host's ranks exit (TCP keepalive on the link between them).",
    )
    kv_events_config: str | None = _arg(
        None,
        "Publish the prefix cache's block stored / removed events for routers that route by "
        "cached blocks, as vLLM's flag does (its JSON and wire format), e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"topic": "kv"}\' (also replay_endpoint, buffer_steps, hwm, max_queue_size); with '
        "--data-parallel-size each rank publishes on the endpoint's port + its rank. Needs "
        "pyzmq (pip install 'pegainfer-core[kv-events]').",
    )
    speculative_tokens: int = _arg(
        0,
        "Speculative decoding: draft this many tokens per request and step, and verify them in "
        "the next step (1 + k tokens per request; greedy output is unchanged, sampled output "
        "keeps the model's distribution). Steps then run one after another (no async "
        "scheduling).",
    )
    speculative_method: str = _arg(
        "mtp",
        "With --speculative-tokens: who drafts. mtp: the checkpoint's multi-token-prediction "
        "layers (lines that have them); self: the model itself, one decode forward per draft "
        "token, so (almost) every draft is accepted: the best case, for measuring a verify "
        "step against accepted length, not for serving.",
    )
    speculative_config: str | None = _arg(
        None,
        "vLLM's form of the two flags above, a JSON object: method (mtp, or a model's MTP name "
        "as vLLM spells it, e.g. deepseek_mtp, glm4_moe_mtp, qwen3_5_mtp; self) and "
        "num_speculative_tokens (default 1, the MTP layers of every checkpoint served), e.g. "
        '\'{"method": "mtp", "num_speculative_tokens": 3}\'.',
    )
    seed: int = _arg(0, "Seed of the sampler for requests that bring none.")
    load_format: str = _arg(
        "auto",
        "auto: read the checkpoint's weights; dummy: draw random weights in place on each "
        "device instead (config.json and the tokenizer still come from --model-path): real "
        "speeds at sizes no disk holds, e.g. a full-size MoE with weights generated per rank.",
    )

    def validate(self) -> EngineArgs:
        """Raise `ConfigError` naming the first bad argument; return self when all are good."""

        def positive(name: str) -> None:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value}")

        if not self.model:
            raise ConfigError("model must name a checkpoint directory or a repo id")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device != "auto" and self.device != "cpu" and not self.device.startswith("cuda"):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks",
                     "tensor_parallel_size", "data_parallel_size",
                     "max_mixed_graph_tokens"):  # fmt: skip
            positive(name)
        if (self.max_mixed_graph_tokens or 0) > self.max_num_batched_tokens:
            raise ConfigError(
                f"max_mixed_graph_tokens ({self.max_mixed_graph_tokens}) must be at most "
                f"max_num_batched_tokens ({self.max_num_batched_tokens}): no step is larger"
            )
        self._check_nodes()
        if self.data_parallel_size > 1:
            if not self.enable_expert_parallel:
                raise ConfigError(
                    "--data-parallel-size needs --enable-expert-parallel: the attention ranks "
                    "divide the routed experts between them"
                )
            if self.tensor_parallel_size > 1:
                raise ConfigError(
                    "--data-parallel-size with --tensor-parallel-size is not supported yet"
                )
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ConfigError(f"block_size must be a power of two up to 256, got {self.block_size}")
        if not (0.0 < self.gpu_memory_utilization <= 1.0):
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_offload_gib <= 0:
            raise ConfigError(f"kv_offload_gib must be positive, got {self.kv_offload_gib}")
        if self.state_checkpoints < 0:
            raise ConfigError(f"state_checkpoints must be 0 or more, got {self.state_checkpoints}")
        sizing = ("num_kv_blocks", "kv_cache_memory_bytes", "cpu_kv_cache_gib")
        sizes = [f"--{n.replace('_', '-')}" for n in sizing if getattr(self, n) is not None]
        if len(sizes) > 1:
            raise ConfigError(f"give the KV cache one size, not {' and '.join(sizes)}")
        positive("kv_cache_memory_bytes")
        if self.cpu_kv_cache_gib is not None and self.cpu_kv_cache_gib <= 0:
            raise ConfigError(f"cpu_kv_cache_gib must be positive, got {self.cpu_kv_cache_gib}")
        if self.kv_events_config is not None:
            events = KVEventsConfig.parse(self.kv_events_config)
            if events.publishes and not self.enable_prefix_caching:
                raise ConfigError(
                    "--kv-events-config reports the prefix cache's blocks: it needs prefix "
                    "caching (drop --no-prefix-cache)"
                )
        if self.speculative_config is not None:
            self._apply_speculative_config()
        if self.speculative_tokens < 0 or self.speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                f"speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], "
                f"got {self.speculative_tokens}"
            )
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ConfigError(
                f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                f"got {self.speculative_method!r}"
            )
        if self.speculative_tokens:
            self._check_speculative()
        if self.decode_attention_tensor_cores not in DECODE_TENSOR_CORE_MODES:
            raise ConfigError(
                "decode_attention_tensor_cores must be one of "
                f"{', '.join(DECODE_TENSOR_CORE_MODES)}, got {self.decode_attention_tensor_cores!r}"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(
                f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}"
            )
        return self

    def _check_nodes(self) -> None:
        """The hosts' flags that need no environment (`distributed.nodes` reads torchrun's)."""
        if self.nnodes < 1:
            raise ConfigError(f"nnodes must be a positive integer, got {self.nnodes}")
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.master_port is not None and not 0 < self.master_port < 1 << 16:
            raise ConfigError(f"master_port must be in [1, 65535], got {self.master_port}")
        for name in ("rendezvous_timeout", "peer_timeout"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ConfigError(
                    f"{name} must be a positive number of seconds, got {getattr(self, name)}"
                )
        world = self.tensor_parallel_size * self.data_parallel_size
        if world % self.nnodes:
            raise ConfigError(
                f"--tensor-parallel-size x --data-parallel-size = {world} ranks do not split "
                f"evenly over --nnodes {self.nnodes} hosts"
            )

    def _apply_speculative_config(self) -> None:
        """Set the speculative flags from `--speculative-config` (a second call finds them
        set to the same values); refuse what it names that pegainfer does not have, and flags
        that say otherwise."""
        method, tokens = parse_speculative_config(self.speculative_config)
        given = {"--speculative-tokens": (self.speculative_tokens, 0, tokens),
                 "--speculative-method": (self.speculative_method, "mtp", method)}  # fmt: skip
        for flag, (value, default, wanted) in given.items():
            if value not in (default, wanted):
                raise ConfigError(
                    f"{flag} {value} contradicts --speculative-config's {wanted}: give one"
                )
        self.speculative_tokens, self.speculative_method = tokens, method

    def _check_speculative(self) -> None:
        """Refuse what speculative decoding does not combine with yet, naming the flags."""
        refused = {
            "--tensor-parallel-size > 1": self.tensor_parallel_size > 1,
            "--data-parallel-size > 1": self.data_parallel_size > 1,
            "--kv-offload": self.kv_offload,
        }
        for flag, given in refused.items():
            if given:
                raise ConfigError(f"--speculative-tokens does not work with {flag} yet")

    def explicit_fields(self) -> set[str]:
        """The arguments set to something other than their default."""
        return {
            f.name
            for f in dataclasses.fields(self)
            if f.default is not dataclasses.MISSING and getattr(self, f.name) != f.default
        }
