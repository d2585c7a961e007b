"""The README's first examples run as written (against the test server's address)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
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


# -- every example of both READMEs, in order, as a user runs them -------------------------

REPO_ROOT = README.parents[2]
TOP_README = REPO_ROOT / "README.md"
#: A marker on the line before a block that cannot run here, with the reason after the colon.
NOT_RUN = re.compile(r"<!-- readme-test: not run \((.+?)\) -->\s*$")
#: Shell lines that run Python: `python3 -c '...'` one-liners and the example scripts.
PYTHON_LINE = re.compile(r"^(?:python3?) (-c '.*'|client/python/examples/\S+\.py\b.*)$")
#: Longest one example may take (the fencing example sleeps past a lease).
EXAMPLE_TIMEOUT_S = 60
#: The address every example is written against, replaced by the test server's.
README_ADDR = "127.0.0.1:7878"


def examples(path: Path):
    """(label, argv tail, reason not run) for every Python example of `path`, in order:
    ```python blocks, and Python command lines in ```sh blocks."""
    text = path.read_text()
    found = []
    for match in re.finditer(r"```(python|sh)\n(.*?)```", text, re.S):
        lang, body = match.group(1), match.group(2)
        line_no = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = NOT_RUN.search(before)
        label = f"{path.relative_to(REPO_ROOT)}:{line_no}"
        if lang == "python":
            found.append((label, ["-c", body], marker.group(1) if marker else None))
            continue
        for line in body.splitlines():
            m = PYTHON_LINE.match(line.strip())
            if m is None:
                continue
            arg = m.group(1)
            argv = ["-c", arg[4:-1]] if arg.startswith("-c '") else shlex.split(arg)
            found.append((label, argv, None))
    return found


def test_every_readme_example_runs_in_order_on_one_server(server):
    """The top-level README's Python lines, then the Python README's examples, in order and
    against one server: an example that leaves a lock held (or anything else behind) breaks
    the next one here as it would for a reader. Each runs in its own interpreter, as written
    (only the address is the test server's), and must exit 0 with nothing on stderr."""
    runs = [e for e in examples(TOP_README) + examples(README)]
    assert len([e for e in examples(TOP_README)]) >= 1, "the top-level README's Python line is gone"
    ran = 0
    for label, argv, not_run in runs:
        code_or_args = [a.replace(README_ADDR, server.addr) for a in argv]
        if not_run is not None:
            if argv[0] == "-c":  # not run, but it must still be valid Python
                compile(argv[1], label, "exec")
            continue
        out = subprocess.run(
            [sys.executable, *code_or_args],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=EXAMPLE_TIMEOUT_S,
        )
        assert out.returncode == 0, f"{label} failed:\n{out.stdout}\n{out.stderr}"
        assert out.stderr == "", f"{label} wrote to stderr:\n{out.stderr}"
        ran += 1
    # lock, asyncio, every operation, fencing, the fencing script, election; the one-liner.
    assert ran >= 7, f"only {ran} README examples ran"


def test_readme_examples_are_all_found():
    """The extraction itself: every ```python block of the Python README is an example (run,
    or marked not run with a reason), so a new block cannot slip past the test."""
    blocks = re.findall(r"```python\n", README.read_text())
    python_examples = [e for e in examples(README) if e[1][0] == "-c"]
    assert len(python_examples) == len(blocks)
    assert all(reason for _, _, reason in python_examples if reason is not None)
