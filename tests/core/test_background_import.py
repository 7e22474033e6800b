"""The engine imports its attention backends' library on a thread while the weights load
(CUDA only), marked in the start-up log when done; a module that cannot be imported is left to
the import that needs it."""

from __future__ import annotations

import logging
import sys

from pegainfer.core.engine.core import _import_in_background
from pegainfer.core.process_info import StartupLog

logger = logging.getLogger("test-background-import")


def test_modules_are_imported_on_a_thread(caplog):
    caplog.set_level(logging.INFO, logger.name)
    sys.modules.pop("colorsys", None)
    thread = _import_in_background(("pegainfer_no_such_module", "colorsys"), StartupLog(logger))
    thread.join(timeout=30)
    assert not thread.is_alive() and "colorsys" in sys.modules
    assert "start-up: colorsys imported (on a thread) at" in caplog.text
    assert "pegainfer_no_such_module" not in caplog.text  # a missing one stops nothing


def test_a_missing_module_raises_nothing_there(caplog):
    caplog.set_level(logging.INFO, logger.name)
    thread = _import_in_background(("pegainfer_no_such_module",), StartupLog(logger))
    thread.join(timeout=30)
    assert not thread.is_alive() and "pegainfer_no_such_module" not in sys.modules
    assert "start-up" not in caplog.text
