"""Reading a run's records back (reports/runs.py) and setting unreadable rows aside (runner/ownership.py):
a row is kept, or set aside beside the file, never dropped; a record that is not whole is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ampctl.cli import main
from ampctl.engine.telemetry import read_metrics
from ampctl.errors import UsageError
from ampctl.reports.runs import load_run, read_rows
from ampctl.runner.ownership import set_aside_unreadable_rows, split_rows

ROW = {"step": 1, "loss": 2.5, "loss_scale": 1024.0, "skipped": False, "skipped_total": 0, "grad_norm": 1.0,
       "lr": 1e-3, "step_time_ms": 10.0, "samples_per_s": 100.0}


def row(step: int) -> str:
    return json.dumps({**ROW, "step": step})


def run_dir_with(tmp_path: Path, metrics: str, summary: str | None = None) -> Path:
    (tmp_path / "metrics.jsonl").write_text(metrics)
    if summary is not None:
        (tmp_path / "summary.json").write_text(summary)
    return tmp_path


def test_a_line_cut_by_a_kill_is_passed_over(tmp_path):
    path = run_dir_with(tmp_path, f"{row(1)}\n{row(2)}\n{row(3)[:20]}") / "metrics.jsonl"
    assert [r["step"] for r in read_rows(path)] == [1, 2]


@pytest.mark.parametrize("bad,reason", [
    ('{"step": 2, "loss": 1.0', "Expecting"),           # garbled
    ('{"loss": 1.0}', "integer 'step'"),               # no step
    ('[1, 2]', "integer 'step'"),                      # not a row
    ('{"step": "2"}', "integer 'step'"),
])
def test_a_line_in_the_middle_that_is_not_a_row_is_named(tmp_path, bad, reason):
    path = run_dir_with(tmp_path, f"{row(1)}\n{bad}\n{row(3)}\n") / "metrics.jsonl"
    with pytest.raises(UsageError, match=rf"metrics.jsonl:2 is not a metrics row \(.*{reason}"):
        read_rows(path)


def test_a_half_written_summary_is_named(tmp_path):
    run_dir = run_dir_with(tmp_path, f"{row(1)}\n", summary='{"steps": 1, "final_lo')
    with pytest.raises(UsageError, match="summary.json is not a whole summary"):
        load_run(run_dir)


@pytest.mark.parametrize("metrics,summary", [
    (f"{row(1)}\n{{garbled\n{row(3)}\n", None),
    (f"{row(1)}\n", '{"steps": 1, "final_lo'),
    (f'{row(1)}\n{{"loss": 1.0}}\n', None),
])
def test_report_on_a_record_that_is_not_whole_is_one_line_exit_2(tmp_path, capsys, restore_argv, metrics, summary):
    run_dir = run_dir_with(tmp_path, metrics, summary)
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(run_dir)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"ampctl report: error: {run_dir}"), err
    expected = ["metrics.jsonl"] + (["summary.json"] if summary else [])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(expected)


def test_the_run_reads_past_a_garbled_row_and_sets_it_aside_keeping_every_valid_row(tmp_path):
    garbled = '{"step": 3, "lo\x00ss": 1'
    path = run_dir_with(tmp_path, f"{row(1)}\n{row(2)}\n{garbled}\n{row(4)}\n{row(5)}\n") / "metrics.jsonl"
    assert [r.step for r in read_metrics(path)] == [1, 2, 4, 5]  # today's summary: every valid row
    [said] = set_aside_unreadable_rows(tmp_path)
    [aside] = tmp_path.glob("metrics.jsonl.set-aside-*")
    assert said == f"metrics.jsonl: 1 unreadable line(s) set aside in {aside.name}"
    assert aside.read_text() == garbled + "\n"
    assert [r["step"] for r in read_rows(path)] == [1, 2, 4, 5]
    assert set_aside_unreadable_rows(tmp_path) == []  # nothing more to set aside


def test_split_rows_sets_aside_the_rows_after_a_step_in_a_free_name(tmp_path):
    path = run_dir_with(tmp_path, "".join(row(s) + "\n" for s in range(1, 7))) / "metrics.jsonl"
    (tmp_path / "metrics.jsonl.set-aside-x").write_text("an earlier one\n")
    [said] = split_rows(path, lambda step: step <= 4, "rows after step 4", "x")
    assert said == "metrics.jsonl: 2 rows after step 4 set aside in metrics.jsonl.set-aside-x-2"
    assert [r["step"] for r in read_rows(path)] == [1, 2, 3, 4]
    assert (tmp_path / "metrics.jsonl.set-aside-x").read_text() == "an earlier one\n"  # never overwritten
    set_aside = (tmp_path / "metrics.jsonl.set-aside-x-2").read_text().splitlines()
    assert [json.loads(line)["step"] for line in set_aside] == [5, 6]


def _job(number: int, start: float, end: float, host: str = "a", threads: int = 2):
    from ampctl.reports.runs import RunRecord

    summary = {"training_window": [start, end], "host": host, "torch_threads": threads, "final_loss": 1.0,
               "skipped_total": 0, "final_loss_scale": 1.0, "samples_per_s": 100.0}
    return RunRecord(Path(f"{number}_optimizer.lr=0.{number}"), summary, [])


@pytest.mark.parametrize("jobs,said", [
    ([_job(0, 0, 10), _job(1, 10, 20), _job(2, 20, 30)], ""),  # one after another (the basic launcher)
    ([_job(0, 0, 10), _job(1, 5, 15), _job(2, 20, 30)], "jobs #0, #1 ran at the same time on one host"),
    ([_job(0, 0, 10), _job(1, 5, 15, host="b")], ""),  # at once on two nodes: each had its machine
    ([_job(0, 0, 10), _job(1, 10, 20, threads=1)], "torch's thread counts differ (#0: 2, #1: 1)"),
])
def test_the_sweep_table_says_when_throughput_does_not_compare(jobs, said):
    from ampctl.reports.tables import not_comparable_throughput, sweep_table

    note = not_comparable_throughput(jobs)
    assert (said in note and note.startswith("throughput not comparable between jobs: ")) if said else note == ""
    assert (note in sweep_table(jobs).notes) == bool(said)


def test_the_sweep_table_at_80_columns_breaks_dotted_keys_and_cuts_no_header(monkeypatch):
    """rich breaks a header at spaces only: at 80 columns `optimizer.lr` was `optimi…` and `samples/s` `sample…`.
    Where the table is wider than the terminal each dotted key breaks after its dots; a figure no job has (MFU on a
    CPU whose peak is unknown) is left off the screen, its empty column kept in the files."""
    import io as stdio

    from rich.console import Console

    from ampctl.reports.runs import RunRecord
    from ampctl.reports.tables import print_table, sweep_table

    monkeypatch.setenv("TERM", "xterm-256color")  # the console is the terminal it says it is, whatever runs the suite
    jobs = [RunRecord(Path(str(n)), {"final_loss": 1.0, "skipped_total": 0, "final_loss_scale": 1024.0,
                                     "samples_per_s": 5317.0, "mfu": None}, [],
                      [f"optimizer.lr=0.{n // 2 + 1}", f"scaler.init_scale={2 ** (10 + n % 2 * 6)}"]) for n in range(4)]
    table = sweep_table(jobs)
    assert "mfu" in table.columns and "mfu" not in table.shown
    for width, broken in ((80, True), (200, False)):
        console = Console(file=stdio.StringIO(), width=width, force_terminal=True, color_system=None)
        print_table(table, console)
        text = console.file.getvalue()
        assert "…" not in text and "samples/s" in text and "MFU" not in text
        assert max(len(line) for line in text.splitlines()) <= width
        assert ("optimizer." in text and "init_scale" in text) if broken else "scaler.init_scale" in text
