"""`kiln report`: one self-contained HTML page of one or more run directories (runs.py reads them, figures.py
says what each chart shows, render.py draws, page.py writes the page)."""
from kiln.report.page import Report, collect, page, write_report
from kiln.report.runs import Run, read_run

__all__ = ["Report", "collect", "page", "write_report", "Run", "read_run"]
