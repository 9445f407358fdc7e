"""The CP layout notebook executes (scripts/execute_notebook.py) and writes its figure."""
import os

from scripts.execute_notebook import execute_notebook

NOTEBOOKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks")


def test_cp_zigzag_layout_notebook(tmp_path):
    # The layout notebook reads no runs: RUNS_DIR is left pointing at an empty folder.
    nb = execute_notebook(str(tmp_path), str(tmp_path), notebook=os.path.join(NOTEBOOKS, "cp_zigzag_layout.ipynb"),
                          timeout_s=300)
    assert (tmp_path / "cp_zigzag_layout.png").stat().st_size > 10_000
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "causal pairs per rank, zigzag: [91, 91]" in printed
