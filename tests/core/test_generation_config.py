"""Tests for the checkpoint sampling defaults read from generation_config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pegainfer.core.errors import ConfigError
from pegainfer.core.loading.generation_config import GenerationDefaults
from pegainfer.core.sampling.sampling_params import SamplingParams

# Qwen3-8B's generation_config.json.
QWEN3 = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "transformers_version": "4.51.0",
}


def write(directory: Path, config: object) -> Path:
    (directory / "generation_config.json").write_text(json.dumps(config))
    return directory


def test_defaults_are_applied(tmp_path: Path) -> None:
    defaults = GenerationDefaults.from_dir(write(tmp_path, QWEN3))
    assert defaults.eos_token_ids == (151645, 151643)
    params = defaults.sampling_params()
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.95, 20)
    # Fields the file does not set keep SamplingParams' own defaults.
    assert params.min_p == SamplingParams().min_p
    assert params.max_tokens == SamplingParams().max_tokens


def test_all_sampling_fields(tmp_path: Path) -> None:
    config = {"temperature": 0.7, "top_p": 0.8, "top_k": 5, "min_p": 0.05, "max_new_tokens": 64}
    config["repetition_penalty"] = 1.1
    defaults = GenerationDefaults.from_dir(write(tmp_path, config))
    params = defaults.sampling_params()
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.7, 0.8, 5, 0.05)
    assert params.max_tokens == 64
    # Kept, but the sampler has no penalties to apply it with.
    assert defaults.repetition_penalty == 1.1


def test_do_sample_false_means_greedy(tmp_path: Path) -> None:
    defaults = GenerationDefaults.from_dir(
        write(tmp_path, {"do_sample": False, "temperature": 0.6})
    )
    assert defaults.sampling_params().greedy
    assert defaults.sampling_params(temperature=0.9).temperature == 0.9


def test_overrides_win(tmp_path: Path) -> None:
    defaults = GenerationDefaults.from_dir(write(tmp_path, QWEN3))
    params = defaults.sampling_params(temperature=0.0, top_k=0, max_tokens=7, stop=["\n"], seed=3)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.0, 0, 7)
    assert params.top_p == 0.95
    assert (params.stop, params.seed) == (["\n"], 3)


def test_eos_union_with_the_tokenizer(tmp_path: Path) -> None:
    write(tmp_path, QWEN3)
    assert GenerationDefaults.from_dir(tmp_path, 151645).eos_token_ids == (151645, 151643)
    assert GenerationDefaults.from_dir(tmp_path, 7).eos_token_ids == (151645, 151643, 7)
    write(tmp_path, {"eos_token_id": 2})
    assert GenerationDefaults.from_dir(tmp_path, 3).eos_token_ids == (2, 3)
    write(tmp_path, {"eos_token_id": None})
    assert GenerationDefaults.from_dir(tmp_path, 3).eos_token_ids == (3,)


def test_missing_file_means_no_defaults(tmp_path: Path) -> None:
    defaults = GenerationDefaults.from_dir(tmp_path)
    assert defaults == GenerationDefaults()
    assert defaults.sampling_params() == SamplingParams()
    assert GenerationDefaults.from_dir(tmp_path, 5).eos_token_ids == (5,)


@pytest.mark.parametrize(
    "config",
    [
        "{not json",
        [1, 2],
        {"eos_token_id": "</s>"},
        {"temperature": "hot"},
        {"top_k": True},
        {"do_sample": "yes"},
    ],
)
def test_malformed_files_are_config_errors(tmp_path: Path, config: object) -> None:
    path = tmp_path / "generation_config.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    with pytest.raises(ConfigError, match="generation_config"):
        GenerationDefaults.from_dir(tmp_path)
