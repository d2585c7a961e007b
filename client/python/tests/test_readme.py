"""The README's first examples run as written (against the test server's address)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
#: The blocks that run on their own: lock, asyncio, every operation.
RUNNABLE_BLOCKS = 3


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[:RUNNABLE_BLOCKS]


@pytest.mark.parametrize("index", range(RUNNABLE_BLOCKS))
def test_readme_example_runs(server, index):
    code = python_blocks()[index].replace("127.0.0.1:7878", server.addr)
    exec(compile(code, f"README.md block {index}", "exec"), {"__name__": "readme"})
