"""The sampling defaults a checkpoint ships in `generation_config.json`.

Model authors tune these (Qwen3 recommends temperature 0.6, top_p 0.95, top_k 20), and the EOS
list there is often longer than the tokenizer's single EOS (Qwen3 chat models stop on both
`<|im_end|>` and `<|endoftext|>`). As in vLLM, a request's explicitly set fields win over them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pegainfer.core.errors import ConfigError
from pegainfer.core.loading.model_files import read_json_object
from pegainfer.core.sampling.sampling_params import SamplingParams

GENERATION_CONFIG_FILE = "generation_config.json"


@dataclass(frozen=True)
class GenerationDefaults:
    """Checkpoint defaults; a None field means the checkpoint does not set it."""

    eos_token_ids: tuple[int, ...] = ()
    do_sample: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_new_tokens: int | None = None
    repetition_penalty: float | None = None

    @classmethod
    def from_dir(
        cls, path: str | Path, tokenizer_eos_token_id: int | None = None
    ) -> GenerationDefaults:
        """Read `generation_config.json` in `path` (absent: no defaults).

        `eos_token_ids` is the file's EOS ids followed by the tokenizer's, when not among them.
        """
        file = Path(path) / GENERATION_CONFIG_FILE
        config = read_json_object(file, required=False)

        eos = config.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if tokenizer_eos_token_id is not None and tokenizer_eos_token_id not in eos_ids:
            eos_ids.append(tokenizer_eos_token_id)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in eos_ids):
            raise ConfigError(f"eos_token_id in {file} must be an integer or a list of integers")

        def number(name: str, kind: type) -> Any:
            value = config.get(name)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"{name} in {file} must be a number, got {value!r}")
            return kind(value)

        do_sample = config.get("do_sample")
        if do_sample is not None and not isinstance(do_sample, bool):
            raise ConfigError(f"do_sample in {file} must be true or false, got {do_sample!r}")
        return cls(
            eos_token_ids=tuple(eos_ids),
            do_sample=do_sample,
            temperature=number("temperature", float),
            top_p=number("top_p", float),
            top_k=number("top_k", int),
            min_p=number("min_p", float),
            max_new_tokens=number("max_new_tokens", int),
            repetition_penalty=number("repetition_penalty", float),
        )

    def sampling_params(self, **overrides: Any) -> SamplingParams:
        """`SamplingParams` with these defaults under `overrides` (a request's explicit fields).

        `do_sample: false` in the file means greedy decoding (temperature 0) unless a request sets
        a temperature. The result is not validated; call `validate()` on it.
        """
        defaults: dict[str, Any] = {}
        if self.do_sample is False:
            defaults["temperature"] = 0.0
        elif self.temperature is not None:
            defaults["temperature"] = self.temperature
        if self.top_p is not None:
            defaults["top_p"] = self.top_p
        if self.top_k is not None:
            defaults["top_k"] = self.top_k
        if self.min_p is not None:
            defaults["min_p"] = self.min_p
        if self.max_new_tokens is not None:
            defaults["max_tokens"] = self.max_new_tokens
        if self.repetition_penalty is not None:
            defaults["repetition_penalty"] = self.repetition_penalty
        return SamplingParams(**{**defaults, **overrides})
