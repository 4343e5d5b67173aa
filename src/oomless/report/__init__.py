"""``oomless report``: one offline HTML file with the memory of a run or an estimate.

Torch-free. plotly (the ``report`` extra) draws the charts; its JavaScript is
embedded in the file so that the report opens without network access.
"""

from __future__ import annotations

from .data import ReportData, load_report_data, report_inputs
from .html import render_html, write_report
from .plotly_dep import require_plotly

__all__ = ["ReportData", "load_report_data", "render_html", "report_inputs", "require_plotly",
           "write_report"]
