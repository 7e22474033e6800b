"""The tiny-checkpoint writer and the offline `pegainfer.LLM` API on its checkpoints."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from pegainfer import LLM, SamplingParams
from pegainfer.core.tiny import main as tiny_main
from pegainfer.models.qwen3.line import Qwen3Line
from tests.paged_runner import PagedRunner, assert_close, hf_logits
from tests.qwen3.hf_reference import load_hf, load_ours


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-qwen3")
    Qwen3Line().write_tiny_checkpoint(path, seed=3, num_hidden_layers=3)
    return path


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:
    # The CPU reference path, wherever the tests run (the GPU path has tests of its own).
    return LLM(str(tiny), max_model_len=256, block_size=8, device="cpu")


@pytest.mark.parametrize(("tie", "shards"), [(True, 1), (False, 3)])
def test_tiny_checkpoint_is_a_transformers_checkpoint(tmp_path, tie, shards):
    Qwen3Line().write_tiny_checkpoint(tmp_path, tie_word_embeddings=tie, num_shards=shards)
    assert len(list(tmp_path.glob("*.safetensors"))) == shards
    tokens = list(range(0, 1000, 37))
    assert_close(
        PagedRunner(load_ours(tmp_path)).step({"a": tokens})["a"],
        hf_logits(load_hf(tmp_path), tokens),
    )
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf_tokenizer("<|im_start|>user\nhi<|im_end|>")["input_ids"][0] == 1025


def test_tiny_cli_writes_a_checkpoint(tmp_path):
    out = tmp_path / "cli"
    cmd = [
        sys.executable,
        "-m",
        "pegainfer.core.tiny",
        "qwen3",
        str(out),
        "--set",
        "num_hidden_layers=1",
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    llm = LLM(str(out), max_model_len=64, device="cpu")
    assert llm.engine.model.cfg.num_layers == 1
    assert llm.generate("hi", SamplingParams(max_tokens=3))[0].finish_reason == "length"


def test_text_generation_equals_transformers(llm, tiny):
    hf = load_hf(tiny)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tiny)
    prompts = ["Hello world", "The quick brown fox jumps", "数字 123 and émoji 🙂", "x"]
    results = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for prompt, result in zip(prompts, results, strict=True):
        ids = hf_tokenizer(prompt, return_tensors="pt")["input_ids"]
        assert result.prompt_token_ids == ids[0].tolist()
        with torch.inference_mode():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=16,
                min_new_tokens=16,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert result.token_ids == out[0, ids.shape[1] :].tolist()
        assert result.text == hf_tokenizer.decode(result.token_ids, skip_special_tokens=True)


def test_chat_renders_the_template(llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    result = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4))[0]
    rendered = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    assert result.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert len(result.token_ids) == 4


def test_stop_strings_truncate_the_text(llm):
    free = llm.generate("Once upon", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[
        0
    ]
    stop = free.text[len(free.text) // 2 :][:3]
    assert stop.strip(), "pick a stop string with visible characters"
    stopped = llm.generate("Once upon", SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[
        0
    ]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == free.text[: free.text.index(stop)]


def test_stop_token_ids_min_tokens_and_ignore_eos(llm):
    free = llm.generate("abc", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    token = free.token_ids[5]
    first = free.token_ids.index(token)
    stopped = llm.generate(
        "abc", SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[token])
    )[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == token
    assert stopped.token_ids == free.token_ids[: first + 1]
    # As vLLM: the stop token is generated and counted, but its text is not output.
    assert stopped.text == llm.tokenizer.decode(stopped.token_ids[:-1])
    # min_tokens holds the stop token back (it is masked) for the first tokens.
    held = llm.generate(
        "abc",
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[token], min_tokens=first + 2),
    )[0]
    assert token not in held.token_ids[: first + 2]


def test_eos_from_generation_config_ends_generation(llm, tiny, tmp_path):
    eos = llm.frontend.defaults.eos_token_ids
    im_end, endoftext = (llm.tokenizer.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>"))
    assert set(eos) == {im_end, endoftext}
    # Declare a token the model is known to produce as EOS, and watch generation stop there.
    free = llm.generate("eos", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    token = free.token_ids[4]
    copy = Path(shutil.copytree(tiny, tmp_path / "ckpt"))
    config = json.loads((copy / "generation_config.json").read_text())
    (copy / "generation_config.json").write_text(json.dumps(config | {"eos_token_id": [token]}))
    llm2 = LLM(str(copy), max_model_len=256, block_size=8, device="cpu")
    stopped = llm2.generate("eos", SamplingParams(temperature=0, max_tokens=12))[0]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", token)
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(token) + 1]
    ignored = llm2.generate("eos", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"


def test_seeds_reproduce_regardless_of_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12, seed=11, ignore_eos=True)
    alone = llm.generate("seeded", params)[0].token_ids
    assert len(set(alone)) > 3, "the distribution is too peaked for this test to mean anything"
    others = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    batch = llm.generate(["noise one", "seeded", "noise two"], [others, params, others])
    assert batch[1].token_ids == alone
    unseeded = [llm.generate("seeded", others)[0].token_ids for _ in range(2)]
    assert unseeded[0] != unseeded[1]


def test_defaults_come_from_generation_config(llm):
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.6, 0.95, 20)


def test_prefix_reuse_is_reported(llm):
    prompt = "A long shared system prompt that spans several blocks of the cache. " * 3
    llm.generate(prompt + "First?", SamplingParams(max_tokens=2))
    second = llm.generate(prompt + "Second?", SamplingParams(max_tokens=2))[0]
    assert second.num_cached_tokens >= 8 * 4


def test_an_interrupted_generate_leaves_the_engine_clean(llm, monkeypatch):
    real_step = llm.engine.step
    calls = {"n": 0}

    def interrupted_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(llm.engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["one", "two"], SamplingParams(max_tokens=8))
    assert not llm.engine.has_unfinished_requests
    assert llm.engine.block_manager.usage == 0.0
    monkeypatch.setattr(llm.engine, "step", real_step)
    assert len(llm.generate("again", SamplingParams(max_tokens=3))[0].token_ids) == 3


def test_a_separate_tokenizer_directory(tiny, tmp_path):
    """--tokenizer / tokenizer=: the checkpoint needs no tokenizer files of its own."""
    weights = tmp_path / "weights"
    shutil.copytree(tiny, weights)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (weights / name).unlink()
    llm = LLM(str(weights), tokenizer=str(tiny), max_model_len=64, device="cpu")
    assert llm.engine.config.tokenizer_dir == tiny.resolve()
    assert llm.generate("hi", SamplingParams(max_tokens=2))[0].finish_reason == "length"


def test_the_serving_path_imports_neither_transformers_nor_sympy(tiny):
    """transformers is a test dependency only; sympy (pulled in by torch's reference ops, e.g.
    `Module.to_empty`) costs seconds of start-up and tens of MB resident."""
    code = (
        "import sys\n"
        "from pegainfer import LLM, SamplingParams\n"
        f"llm = LLM({str(tiny)!r}, device='cpu', max_model_len=64)\n"
        "llm.generate('hi', SamplingParams(max_tokens=2))\n"
        "import pegainfer.server.app\n"
        "print(sorted(m for m in ('transformers', 'sympy') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_tiny_cli_leaves_nothing_behind_when_writing_fails(tmp_path, monkeypatch):
    """It once left a half-written folder (numpy missing mid-write) that then failed to load."""

    def fail_halfway(self, out_dir, **kwargs):
        (out_dir / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(Qwen3Line, "write_tiny_checkpoint", fail_halfway)
    with pytest.raises(OSError, match="disk full"):
        tiny_main(["qwen3", str(tmp_path / "tiny")])
    assert list(tmp_path.iterdir()) == []


def test_tiny_cli_replaces_an_older_checkpoint_whole(tmp_path):
    out = tmp_path / "tiny"
    assert tiny_main(["qwen3", str(out), "--num-shards", "2"]) == 0
    assert tiny_main(["qwen3", str(out), "--set", "num_hidden_layers=1"]) == 0
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1
    assert not list(out.glob("model-*.safetensors"))  # nothing of the older one is left
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]


def test_tiny_cli_will_not_replace_a_folder_that_holds_no_checkpoint(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert tiny_main(["qwen3", str(tmp_path)]) == 2
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert "holds no checkpoint" in capsys.readouterr().err


def test_close_drops_the_engine_and_refuses_to_generate(tiny):
    """`close` (also the context manager's exit) leaves nothing holding the engine, so its
    weights and cache go (on CUDA: tests/core/test_engine_memory_gpu.py); a closed LLM says so."""
    import gc
    import weakref

    with LLM(str(tiny), max_model_len=64, block_size=8, device="cpu") as llm:
        assert llm.generate("hi", SamplingParams(max_tokens=2))[0].finish_reason == "length"
        engine, model = weakref.ref(llm.engine), weakref.ref(llm.engine.model)
    gc.collect()
    assert engine() is None and model() is None
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate("hi", SamplingParams(max_tokens=2))
    llm.close()  # idempotent
