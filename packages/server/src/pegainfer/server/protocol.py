"""OpenAI request and response bodies as msgspec structs.

Requests keep every field a client may send, so that a field we cannot honour yet is refused
by name instead of being dropped: `unsupported_fields` lists the ones set to something other
than their no-op value. Unknown fields are accepted (and logged once by the app).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

# Every integer a request carries fits in a signed 64-bit integer, as the engine's message
# boundary needs; the decoder refuses anything larger with a 400 naming the field, before any
# work or reservation. The fields' own ranges are checked where they are used.
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]

# ---------------------------------------------------------------------------- requests


class StreamOptions(msgspec.Struct, omit_defaults=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The sampling and stopping fields completions and chat share."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    skip_special_tokens: bool = True
    # vLLM's: our decoding never puts spaces between special tokens (false); true only matters
    # when they are not skipped, and is then refused.
    spaces_between_special_tokens: bool | None = None
    # Informational only.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    # Choices, penalties, logprobs and output constraints.
    n: Int64 = 1
    best_of: Int64 | None = None
    logprobs: Any = None
    top_logprobs: Int64 | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    include_stop_str_in_output: bool = False
    prompt_logprobs: Int64 | None = None
    # Separates this request's prefix-cache entries from other tenants'.
    cache_salt: str | None = None
    # vLLM's: keep only the prompt's last (or first) tokens; -1: as many as the context holds.
    truncate_prompt_tokens: Int64 | None = None
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's: the prompt's and the answer's token ids in the response; logprobs' tokens as
    # "token_id:N" (for tokens whose text is not valid UTF-8 alone).
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: the only tokens the answer may use; words it may not contain.
    allowed_token_ids: list[Int64] | None = None
    bad_words: list[str] | None = None
    # vLLM's and OpenAI's fields that change the output or how it is made, not implemented:
    # refused by name (see _NOT_YET) unless at their "off" value.
    use_beam_search: Any = False
    length_penalty: Any = 1.0
    priority: Any = 0
    logits_processors: Any = None
    structural_tag: Any = None
    guided_whitespace_pattern: Any = None
    vllm_xargs: Any = None
    kv_transfer_params: Any = None


# Fields that change the output and are not implemented yet, with the values that mean "off".
_NOT_YET: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "chat_template": (None,),
    "use_beam_search": (False,),
    "length_penalty": (1.0, 1),
    "priority": (0,),
    "logits_processors": (None, []),
    "structural_tag": (None,),
    "guided_whitespace_pattern": (None,),
    "vllm_xargs": (None, {}),
    "kv_transfer_params": (None,),
    "prompt_embeds": (None,),
    "reasoning_effort": (None,),
    "documents": (None, []),
    "mm_processor_kwargs": (None, {}),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
}
# Chat's only: completions implement their own echo, and add special tokens to a prompt.
_NOT_YET_IN_CHAT = {"echo": (False,), "add_special_tokens": (False,)}


def _is_off(value: Any, offs: tuple[Any, ...]) -> bool:
    # Types must match too: `echo: 0` is not the `echo: false` that means off.
    return any(type(value) is type(off) and value == off for off in offs)


def unsupported_fields(request: msgspec.Struct) -> list[str]:
    """Fields of `request` set to a value we cannot honour yet."""
    not_yet = _NOT_YET | (_NOT_YET_IN_CHAT if isinstance(request, ChatCompletionRequest) else {})
    found = [
        name
        for name, offs in not_yet.items()
        if hasattr(request, name) and not _is_off(getattr(request, name), offs)
    ]
    return found


class CompletionRequest(_SamplingFields, kw_only=True, omit_defaults=True):
    # A string, a list of strings, token ids, or a list of token-id lists (checked on use:
    # msgspec cannot express a union of list types).
    prompt: str | list[Any]
    max_tokens: Int64 | None = 16
    echo: bool = False
    # vLLM's: the tokenizer's post-processor adds its special tokens (a BOS) to text prompts.
    add_special_tokens: bool = True
    suffix: str | None = None
    prompt_embeds: Any = None


class TextPart(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ImagePart(msgspec.Struct, tag_field="type", tag="image_url"):
    image_url: Any


class ChatMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True, omit_defaults=True):
    messages: list[ChatMessage]
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    include_reasoning: bool = True  # false: the reasoning parser's split-off text is dropped
    echo: Any = False
    add_special_tokens: Any = False
    reasoning_effort: Any = None
    documents: Any = None
    mm_processor_kwargs: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None


class TokenizeRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[Int64]
    model: str | None = None


# --------------------------------------------------------------------------- responses


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class CompletionTokensDetails(msgspec.Struct):
    reasoning_tokens: int


class Usage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = None  # with a reasoning parser


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob]


class PromptLogprob(msgspec.Struct):
    """vLLM's entry of one candidate token at one prompt position."""

    logprob: float
    rank: int
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token, {token id: entry} of the token itself and the most
# likely ones (null for the first token, which nothing before it scores).
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # vLLM's, null unless asked for (return_token_ids; a stream sends the prompt's once).
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: Literal["text_completion"] = "text_completion"


class AssistantMessage(msgspec.Struct, omit_defaults=True):
    role: Literal["assistant"]
    content: str | None  # null when the answer is only tool calls
    # With --reasoning-parser: the thinking, under vLLM's current name and its older one.
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # with --tool-call-parser


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    # With return_token_ids, in a choice's first chunk; absent from the others, as vLLM's.
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class ModelCard(msgspec.Struct):
    id: str
    created: int
    max_model_len: int
    root: str
    object: Literal["model"] = "model"
    owned_by: str = "pegainfer"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"


class ModelInfo(msgspec.Struct):
    """`/get_model_info`, in SGLang's shape (routers read it to name a worker's model)."""

    model_path: str
    tokenizer_path: str
    served_model_names: list[str]
    is_generation: bool = True


class ServerInfo(msgspec.Struct):
    """`/get_server_info`, in SGLang's shape: what a router needs to know of a worker's
    cache and parallel layout. vllm-router's KV-event discovery reads `model_id` (whose
    tokenizer it hashes prompts with) and `kv_block_size` (the tokens per hashed block)."""

    model_id: str
    model_path: str
    served_model_names: list[str]
    max_model_len: int
    kv_block_size: int
    num_kv_blocks: int
    dp_size: int
    tp_size: int
    version: str


class KVEventSource(msgspec.Struct):
    """One attention rank's KV-event publisher, as `/kv_event_sources` reports it (vLLM's
    route: the resolved publisher configuration keyed by data-parallel rank)."""

    endpoint: str
    replay_endpoint: str | None
    topic: str
    publisher: str = "zmq"
    enable_kv_cache_events: bool = True
    encoding: str = "msgpack"
    schema_version: int = 1


class Load(msgspec.Struct):
    """`/get_load`: requests this server holds, waiting or running (what routers that balance
    by load, e.g. vllm-router's power_of_two, poll)."""

    load: int


class TokenizeResponse(msgspec.Struct):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None  # with return_token_strs: each token's vocabulary entry


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo
