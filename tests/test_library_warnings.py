"""transformers' one-time warnings as no-ops in traced code (te_compile/library_warnings.py), whichever
of te and transformers is imported first; the graph that holds them is tested in
test_linear_cross_entropy.py (GPT-2's head and loss fused, no graph break)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("transformers", reason="needs transformers for its logging module")

_CHECK = """
import inspect, torch
from transformers.utils import logging
assert logging.warning_once in torch._dynamo.config.ignore_logging_functions
assert "lru_cache" in inspect.getsource(logging)   # the module's own loader still serves its source
torch._dynamo.reset()
assert logging.warning_once in torch._dynamo.config.ignore_logging_functions   # Dynamo's reset keeps it
"""


@pytest.mark.parametrize("first", ["te_compile", "transformers"])
def test_warning_once_is_ignored_by_dynamo_whichever_is_imported_first(first):
    code = f"import {first}\nimport te_compile\n{_CHECK}"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_user_who_discards_it_keeps_it_discarded():
    code = """
import te_compile, torch
from transformers.utils import logging
torch._dynamo.config.ignore_logging_functions.discard(logging.warning_once)
torch.compile(torch.nn.Linear(16, 16), backend="te", options={"compiler": "aot_eager"})(torch.randn(16, 16))
assert te_compile.report().sites   # te compiled a graph
assert logging.warning_once not in torch._dynamo.config.ignore_logging_functions
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
