"""Execute notebooks/acceptance_vs_step.ipynb on a folder of runs, headless (nbclient, this venv's kernel).

  python scripts/execute_notebook.py RUNS_DIR OUT_DIR [--executed PATH]

RUNS_DIR holds the dump folders cotrain/, frozen/ and none/ of one job run three times
(scripts/drift_demo.sh makes them); the PNGs and acceptance_summary.json go to OUT_DIR.
"""
import argparse
import os

NOTEBOOK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks",
                        "acceptance_vs_step.ipynb")


def execute_notebook(runs_dir: str, out_dir: str, executed_path: str | None = None, notebook: str = NOTEBOOK,
                     timeout_s: int = 600):
    """Run every cell with RUNS_DIR / OUT_DIR in the kernel's environment; returns the executed notebook
    (also written to executed_path when given). A failing cell raises nbclient's CellExecutionError."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(notebook, as_version=4)
    env = {**os.environ, "RUNS_DIR": os.path.abspath(runs_dir), "OUT_DIR": os.path.abspath(out_dir),
           "MPLBACKEND": "Agg"}
    client = NotebookClient(nb, timeout=timeout_s, kernel_name="python3",
                            resources={"metadata": {"path": os.path.dirname(notebook)}})
    client.execute(env=env)
    if executed_path:
        nbformat.write(nb, executed_path)
    return nb


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs_dir")
    p.add_argument("out_dir")
    p.add_argument("--executed", help="also write the executed notebook (with outputs) here")
    a = p.parse_args()
    execute_notebook(a.runs_dir, a.out_dir, a.executed)
    print(f"wrote {os.path.join(a.out_dir, 'acceptance_summary.json')} and the PNGs")


if __name__ == "__main__":
    main()
