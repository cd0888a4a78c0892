"""reports/tables.print_table: a table whose screen is for narrow terminals shows every column where they fit, and
its screen's columns, with the line that says where the others are, where they do not."""

from __future__ import annotations

import io

from rich.console import Console

from ampctl.reports.tables import ReportTable, print_table


def printed(table: ReportTable, width: int) -> str:
    out = io.StringIO()
    print_table(table, Console(file=out, width=width, force_terminal=True, color_system=None))
    return out.getvalue()


def test_a_narrow_terminal_gets_the_screen_and_a_wide_one_every_column():
    columns = ["precision", *[f"component_number_{i}" for i in range(6)], "total"]
    table = ReportTable("t", columns, [["fp32", *range(6), 15]], screen=["precision", "sum", "total"],
                        cells={"sum": lambda row: str(sum(row[f"component_number_{i}"] for i in range(6)))},
                        screen_note="each component in report.md", screen_when_narrow=True)
    wide = printed(table, 250)
    assert "component_number_5" in wide and "each component" not in wide
    narrow = printed(table, 60)
    assert "component_number" not in narrow and "sum" in narrow and "each component in report.md" in narrow
    assert all(len(line) <= 60 for line in narrow.splitlines()) and "…" not in narrow
    table.screen_when_narrow = False  # a screen for every terminal (compare's)
    assert "component_number" not in printed(table, 250)
