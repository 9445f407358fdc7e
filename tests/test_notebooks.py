"""The figure notebooks execute and write their figures (nbclient, the venv's own kernel)."""
import os

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks")


def execute(name: str, env: dict[str, str]) -> nbformat.NotebookNode:
    nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits the environment
    try:
        NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": NOTEBOOKS}}).execute()
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return nb


def test_cp_zigzag_layout_notebook(tmp_path):
    nb = execute("cp_zigzag_layout.ipynb", {"OUT_DIR": str(tmp_path)})
    assert (tmp_path / "cp_zigzag_layout.png").stat().st_size > 10_000
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "causal pairs per rank, zigzag: [91, 91]" in printed
