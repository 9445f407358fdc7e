"""metrics.jsonl keeps one row per step across resumes, the console line shows one acceptance-length
figure, and progress reads well in a log file (titan_draft/infra/metrics.py)."""
import io
import re

from titan_draft.infra.metrics import MetricsLogger, progress, read_metrics


def log_all(folder, rows) -> None:
    metrics = MetricsLogger(str(folder), tensorboard=False)
    for phase, step, value in rows:
        metrics.log(phase, step, {"loss": value}, echo=False)
    metrics.close()


def test_replayed_steps_replace_their_rows(tmp_path):
    log_all(tmp_path, [("sft", 1, 0.9), ("sft", 2, 0.8), ("rl", 1, 1.0), ("rl", 2, 2.0), ("rl", 3, 3.0)])
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"phase": "rl", "step": 4, "lo')  # the line a SIGKILL cut short
    # Resumed from the checkpoint after RL step 1: steps 2.. are redone (with other timings, say).
    log_all(tmp_path, [("rl", 2, 2.5), ("rl", 3, 3.5), ("rl", 4, 4.5)])
    rows = [(r["phase"], r["step"], r["loss"]) for r in read_metrics(str(tmp_path / "metrics.jsonl"))]
    assert rows == [("sft", 1, 0.9), ("sft", 2, 0.8), ("rl", 1, 1.0), ("rl", 2, 2.5), ("rl", 3, 3.5), ("rl", 4, 4.5)]
    # Started over without a checkpoint: the whole history is redone.
    log_all(tmp_path, [("sft", 1, 0.7)])
    assert read_metrics(str(tmp_path / "metrics.jsonl")) == [{"phase": "sft", "step": 1, "loss": 0.7}]


def test_console_line_shows_one_acceptance_length_and_the_file_keeps_both(tmp_path, capsys):
    metrics = MetricsLogger(str(tmp_path), tensorboard=False)
    metrics.log("rl", 1, {"tokens_per_verify_forward": 3.25, "spec_acceptance_length": 3.75})
    metrics.close()
    assert capsys.readouterr().out == "[rl    1] spec_acceptance_length 3.75\n"
    assert read_metrics(str(tmp_path / "metrics.jsonl")) == [
        {"phase": "rl", "step": 1, "tokens_per_verify_forward": 3.25, "spec_acceptance_length": 3.75}]


def run_bar(steps: int, **kwargs) -> None:
    bar = progress(range(1, steps + 1), "sft", **kwargs)
    for step in bar:
        bar.set_postfix(loss=f"{1 / step:.3f}", refresh=False)


def test_progress_in_a_log_file_is_whole_lines(capsys):
    """stderr is no terminal here, as under torchrun --tee: whole lines, no carriage-return redraws."""
    run_bar(5)  # well within the 10 s between lines: only the final one
    err = capsys.readouterr().err
    assert "\r" not in err and re.fullmatch(r"sft: 5/5 \(100%\)  \S+ it/s  eta 0 s  loss 0\.200\n", err), repr(err)
    run_bar(3, interval=0.0)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split("  ")[0] for line in lines] == ["sft: 1/3 (33%)", "sft: 2/3 (66%)", "sft: 3/3 (100%)"]
    assert lines[1].endswith("loss 0.500")
    run_bar(3, enabled=False)  # other ranks
    assert capsys.readouterr().err == ""


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_is_a_bar(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    run_bar(3)
    assert "\r" in terminal.getvalue() and "3/3" in terminal.getvalue()
