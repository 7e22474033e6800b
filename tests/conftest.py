"""Suite-wide test configuration: GPU tests skip where CUDA is absent, and so do the tests of
model lines that are not installed (the README's `uv sync --extra qwen3` installs one line:
the others' tests are skipped, not collection errors); after a failed test, what it left on
the device is given back before the next one sizes its KV cache."""

import gc
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

# Each model line, the module it installs, and the extra that installs it.
LINES = {
    "qwen3": ("pegainfer.models.qwen3", "qwen3"),
    "qwen35": ("pegainfer.models.qwen35", "qwen35"),
    "deepseek": ("pegainfer.models.deepseek", "deepseek"),
    "kimi_k2": ("pegainfer.models.kimi_k2", "kimi-k2"),
    "glm5": ("pegainfer.models.glm5", "glm5"),
}
MISSING = {line for line, (module, _) in LINES.items() if find_spec(module) is None}
TESTS = Path(__file__).parent


def missing_line(name: str) -> str | None:
    """The model line that `name` (a test folder or a parameter such as "deepseek-ep") needs
    and that is not installed, else None."""
    line = name.split("-")[0]
    return line if line in MISSING else None


def _skip_reason(line: str) -> str:
    return f"the {line} line is not installed (pip install 'pegainfer[{LINES[line][1]}]')"


def pytest_report_header(config: pytest.Config) -> str | None:
    if MISSING:
        return "model lines not installed, their tests skip: " + ", ".join(sorted(MISSING))
    return None


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """A missing line's own test folder is not even imported (its modules import the line)."""
    if collection_path.parent == TESTS and missing_line(collection_path.name):
        return True
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if gpu_skip is not None and "gpu" in item.keywords:
            item.add_marker(gpu_skip)
        # A test marked `line(name)`, or parametrized by a `line`, needs that line.
        params = getattr(getattr(item, "callspec", None), "params", {})
        needed = [m.args[0] for m in item.iter_markers("line")] + [params.get("line")]
        missing = [missing_line(name) for name in needed if isinstance(name, str)]
        if any(missing):
            item.add_marker(pytest.mark.skip(reason=_skip_reason(next(filter(None, missing)))))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    """After a failed test and its fixtures' teardown: pytest keeps the last failure's
    traceback for post-mortem debugging (`sys.last_traceback`), and with it the failed test's
    locals, so an engine it built would keep its share of the GPU (gpu_memory_utilization)
    while the next test builds its own and finds no memory left. Drop it, collect, and give the
    cached blocks back to the driver (engines size their cache from what the driver reports
    free). A passing test's engines go with its frame."""
    result = yield
    if getattr(sys, "last_traceback", None) is not None:
        for name in ("last_type", "last_value", "last_traceback", "last_exc"):
            if hasattr(sys, name):
                setattr(sys, name, None)
        gc.collect()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
    return result


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """`prefill_length` takes each of its test class's `PREFILL_LENGTHS`
    (tests/paged_runner.py: `ForwardMatchesTransformers`)."""
    if "prefill_length" in metafunc.fixturenames:
        metafunc.parametrize("prefill_length", metafunc.cls.PREFILL_LENGTHS)
