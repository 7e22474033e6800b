"""Loading: local directories, repo ids from the hub cache, and the errors for bad checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import huggingface_hub
import pytest
import torch
from safetensors.torch import load_file, save_file

from pegainfer.core.errors import ConfigError, InvalidRequestError, ModelLineError, WeightLoadError
from pegainfer.core.sampling.sampling_params import SamplingParams
from tests.engine_harness import drain, greedy, make_engine, submit


@pytest.fixture
def checkpoint(hf_checkpoints, tmp_path) -> Path:
    """A private copy of the tied checkpoint that a test may damage."""
    return Path(shutil.copytree(hf_checkpoints(True), tmp_path / "ckpt"))


def edit_weights(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_unclaimed_config(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps(config | {"model_type": "llama"}))
    with pytest.raises(ModelLineError, match="no installed model line supports model_type 'llama'"):
        make_engine(checkpoint)


def test_missing_weight_files(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(WeightLoadError, match=r"no \*\.safetensors weight files"):
        make_engine(checkpoint)


def test_missing_tensor_is_named(checkpoint):
    edit_weights(checkpoint, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(WeightLoadError, match=r"lacks 1 tensor.*layers\.1\.gate_up_proj"):
        make_engine(checkpoint)


def test_wrong_shape_is_named(checkpoint):
    def shrink(tensors):
        tensors["model.norm.weight"] = tensors["model.norm.weight"][:10]

    edit_weights(checkpoint, shrink)
    with pytest.raises(WeightLoadError, match=r"'model\.norm\.weight' has shape \(10,\)"):
        make_engine(checkpoint)


def test_unexpected_tensor_is_named(checkpoint):
    edit_weights(checkpoint, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.ones(2)}))
    with pytest.raises(WeightLoadError, match="maps to unknown parameter 'layers.0.extra'"):
        make_engine(checkpoint)


def test_unsupported_variant_is_refused(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="RoPE scaling"):
        make_engine(checkpoint)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ConfigError, match="holds no config.json"):
        make_engine(tmp_path)
    with pytest.raises(ConfigError, match="neither a local directory nor a Hugging Face repo id"):
        make_engine(tmp_path / "missing" / "dir")


def test_repo_id_from_the_hub_cache(hf_checkpoints, tmp_path, monkeypatch):
    """A repo id resolves through the local Hugging Face cache; an uncached one fails clearly."""
    # huggingface_hub reads its environment at import, so patch its constants.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--tiny--qwen3"
    revision = "0" * 40
    shutil.copytree(hf_checkpoints(True), repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    engine = make_engine("tiny/qwen3")
    assert engine.config.model_dir == repo / "snapshots" / revision
    with pytest.raises(ConfigError, match="hub is unreachable"):
        make_engine("tiny/not-cached")


@pytest.fixture(scope="module")
def engine(hf_checkpoints):
    return make_engine(hf_checkpoints(True), max_model_len=64)


def test_prompt_longer_than_the_context(engine):
    with pytest.raises(InvalidRequestError, match="prompt has 64 tokens.*context is 64") as err:
        submit(engine, "a", list(range(64)), greedy(1))
    assert err.value.param == "prompt"


def test_prompt_plus_max_tokens_over_the_context(engine):
    with pytest.raises(InvalidRequestError, match=r"plus max_tokens \(10\) exceeds"):
        submit(engine, "a", list(range(60)), greedy(10))


def test_out_of_vocabulary_prompt_and_bad_sampling(engine):
    with pytest.raises(InvalidRequestError, match="out of vocabulary"):
        submit(engine, "a", [1, 10_000], greedy(1))
    with pytest.raises(InvalidRequestError, match="temperature"):
        submit(engine, "a", [1], SamplingParams(temperature=-1))
    with pytest.raises(InvalidRequestError, match="at least one token"):
        submit(engine, "a", [], greedy(1))
    assert not engine.has_unfinished_requests


def test_max_tokens_none_fills_the_context(engine):
    submit(engine, "a", list(range(60)), SamplingParams(temperature=0, max_tokens=None))
    assert len(drain(engine)["a"]) == 4


def test_duplicate_request_id(engine):
    submit(engine, "dup", [1, 2], greedy(2))
    with pytest.raises(InvalidRequestError, match="already in use"):
        submit(engine, "dup", [1, 2], greedy(2))
    drain(engine)
