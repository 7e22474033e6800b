"""The engine imports its attention backends' library on a thread while the weights load
(CUDA only); a module that cannot be imported is left to the import that needs it."""

from __future__ import annotations

import sys

from pegainfer.core.engine.core import _import_in_background


def test_a_module_is_imported_on_a_thread():
    sys.modules.pop("colorsys", None)
    thread = _import_in_background("colorsys")
    thread.join(timeout=30)
    assert not thread.is_alive() and "colorsys" in sys.modules


def test_a_missing_module_raises_nothing_there():
    thread = _import_in_background("pegainfer_no_such_module")
    thread.join(timeout=30)
    assert not thread.is_alive() and "pegainfer_no_such_module" not in sys.modules
