"""Plugin discovery and model-line detection."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from pegainfer.core.args import EngineArgs
from pegainfer.core.engine.core import EngineCore
from pegainfer.core.errors import ConfigError, ModelLineError
from pegainfer.core.model_line import ModelLine, Probe
from pegainfer.core.plugins import (
    create_plugin_manager,
    detect_model_line,
    hookimpl,
    model_lines,
)
from pegainfer.core.sampling.sampling_params import SamplingParams
from tests.engine_harness import drain, submit

FIXTURE = Path(__file__).parent / "plugin_fixture" / "counting_line.py"


@pytest.fixture
def installed_counting_plugin(tmp_path, monkeypatch) -> Path:
    """Install the test-only line as a third party would: a module plus an entry point."""
    shutil.copy(FIXTURE, tmp_path / "counting_line.py")
    dist_info = tmp_path / "pegainfer_counting-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: pegainfer-counting\nVersion: 0.1\n"
    )
    (dist_info / "entry_points.txt").write_text("[pegainfer]\ncounting = counting_line\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_installed_lines_are_discovered():
    assert "qwen3" in [line.name for line in model_lines()]


def test_a_third_party_line_serves_through_the_engine(installed_counting_plugin, tmp_path):
    names = [line.name for line in model_lines()]
    assert {"qwen3", "counting"} <= set(names)
    model_dir = tmp_path / "ckpt"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "counting", "vocab_size": 50}))
    engine = EngineCore(EngineArgs(model=str(model_dir), device="cpu"))
    assert engine.config.line == "counting"
    submit(engine, "r", [3, 4, 5], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert drain(engine) == {"r": [6, 7, 8, 9, 10, 11]}
    # An argument the line declares it does not use is refused, not silently ignored.
    with pytest.raises(
        ConfigError, match="'counting' model line does not use these arguments: block_size"
    ):
        EngineCore(EngineArgs(model=str(model_dir), device="cpu", block_size=4))


@pytest.mark.parametrize(
    "wrong",
    [
        lambda logits, batch: logits.new_zeros(batch.input_ids.shape[0], logits.shape[1]),
        lambda logits, batch: logits[:, :-1],
        lambda logits, batch: logits.half(),
    ],
    ids=["every-row", "short-vocabulary", "float16"],
)
def test_a_forward_breaking_the_logits_contract_is_refused_when_the_line_loads(
    installed_counting_plugin, tmp_path, monkeypatch, wrong
):
    """A forward returning logits of the wrong shape (or dtype) was served."""
    import counting_line

    right = counting_line.CountingModel.forward
    monkeypatch.setattr(counting_line.CountingModel, "forward",
                        lambda self, batch, kv: wrong(right(self, batch, kv), batch))  # fmt: skip
    model_dir = tmp_path / "ckpt"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "counting", "vocab_size": 50}))
    with pytest.raises(ModelLineError, match=r"'counting' model line's forward returned"):
        EngineCore(EngineArgs(model=str(model_dir), device="cpu"))


def test_plugin_allow_list(installed_counting_plugin, monkeypatch):
    monkeypatch.setenv("PEGAINFER_PLUGINS", "counting")
    assert [line.name for line in model_lines()] == ["counting"]
    monkeypatch.setenv("PEGAINFER_PLUGINS", "")
    assert model_lines(create_plugin_manager()) == []


class _Line(ModelLine):
    def __init__(self, name: str, claims: set[str]) -> None:
        self.name = name
        self.claims = claims

    def probe(self, config: dict[str, Any]) -> Probe:
        if config.get("model_type") in self.claims:
            return Probe.claim()
        return Probe.reject(f"{self.name} only serves {sorted(self.claims)}")

    def build_model(self, ctx):  # pragma: no cover - never built here
        raise AssertionError


def test_exactly_one_line_claims():
    a, b = _Line("a", {"x"}), _Line("b", {"y"})
    assert detect_model_line({"model_type": "y"}, [a, b]) is b


def test_two_claims_name_both():
    with pytest.raises(ModelLineError, match="'a' and 'b'"):
        detect_model_line({"model_type": "x"}, [_Line("a", {"x"}), _Line("b", {"x"})])


def test_no_claim_lists_each_reason():
    with pytest.raises(ModelLineError) as err:
        detect_model_line({"model_type": "z"}, [_Line("a", {"x"}), _Line("b", {"y"})])
    assert "a only serves ['x']" in str(err.value) and "b only serves ['y']" in str(err.value)


@pytest.mark.parametrize(
    ("config", "extra"),
    [
        ({"model_type": "qwen3_5"}, "qwen35"),
        ({"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text"}}, "qwen35"),
        ({"model_type": "deepseek_v2"}, "deepseek"),
        ({"model_type": "kimi_k2"}, "kimi-k2"),
        ({"model_type": "deepseek_v3"}, "kimi-k2"),
        ({"model_type": "glm_moe_dsa"}, "glm5"),
    ],
)
def test_known_family_names_its_extra(config, extra):
    """With only the Qwen3 line installed, a checkpoint of another known family says which
    extra serves it."""
    with pytest.raises(ModelLineError, match=rf"pip install 'pegainfer\[{extra}\]'"):
        detect_model_line(config, [_Line("qwen3", {"qwen3"})])


def test_duplicate_line_names_are_refused():
    pm = create_plugin_manager(load_entry_points=False)

    class Plugin:
        @hookimpl
        def pegainfer_model_lines(self) -> list[ModelLine]:
            return [_Line("a", {"x"})]

    pm.register(Plugin(), "one")
    pm.register(Plugin(), "two")
    with pytest.raises(ModelLineError, match="registered twice: a"):
        model_lines(pm)


def install_plugin(tmp_path: Path, monkeypatch, name: str, source: str) -> None:
    """A plugin module `name` with an entry point of the same name, as a third party's."""
    (tmp_path / f"{name}.py").write_text(source)
    dist_info = tmp_path / f"pegainfer_{name}-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: pegainfer-{name}\n"
                                        "Version: 0.1\n")  # fmt: skip
    (dist_info / "entry_points.txt").write_text(f"[pegainfer]\n{name} = {name}\n")
    monkeypatch.syspath_prepend(str(tmp_path))


BROKEN_PLUGINS = {
    "raises_on_import": ("raise RuntimeError('a missing CUDA library')", "a missing CUDA library"),
    "no_hookimpl": ("def pegainfer_model_lines():\n    return []\n", "not decorated with"),
    "hook_typo": ("from pegainfer.core.plugins import hookimpl\n\n@hookimpl\n"
                  "def pegainfer_model_line():\n    return []\n", "not a pegainfer hook"),
    "no_hooks": ("def model_lines():\n    return []\n", "defines none of the hooks"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(BROKEN_PLUGINS))
def test_a_broken_plugin_is_left_out_and_named(tmp_path, monkeypatch, caplog, name):
    """It took the server down for every model (or was ignored without a word), naming neither
    the plugin nor PEGAINFER_PLUGINS."""
    source, why = BROKEN_PLUGINS[name]
    install_plugin(tmp_path, monkeypatch, name, source)
    assert "qwen3" in [line.name for line in model_lines()]  # the other lines still load
    logged = caplog.text
    assert name in logged and why in logged and "PEGAINFER_PLUGINS" in logged
    with pytest.raises(ModelLineError) as err:
        detect_model_line({"model_type": "mine"}, model_lines())
    assert f"{name}: " in str(err.value) and why in str(err.value)


@pytest.mark.line("qwen35")
def test_pegainfer_plugins_naming_an_installed_line_out_is_not_a_missing_extra(monkeypatch, caplog):
    monkeypatch.setenv("PEGAINFER_PLUGINS", "qwen3,qwen3five")
    lines = model_lines()
    assert "qwen3five" in caplog.text and "no installed plugin" in caplog.text
    with pytest.raises(ModelLineError) as err:
        detect_model_line({"model_type": "qwen3_5"}, lines)
    assert "installed but not loaded" in str(err.value) and "pip install" not in str(err.value)


def test_a_model_type_no_family_serves_says_so_plainly():
    with pytest.raises(ModelLineError, match="pegainfer has no model line for it"):
        detect_model_line({"model_type": "llama"}, model_lines())


def test_a_line_with_no_kv_arenas_is_refused_by_name():
    """kv_arenas() returning [] ended in ZeroDivisionError."""
    from pegainfer.core.kv.kv_cache import blocks_for_memory

    with pytest.raises(ModelLineError, match="at least one KV arena"):
        blocks_for_memory([], 1 << 30)
