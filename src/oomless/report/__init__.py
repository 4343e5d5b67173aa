"""``oomless report``: one offline HTML file with the memory of a run or an estimate.

Torch-free. plotly (the ``report`` extra) draws the charts; its JavaScript is
embedded in the file so that the report opens without network access.
"""

from __future__ import annotations

from types import ModuleType

from ..errors import OomlessError


def require_plotly() -> ModuleType:
    try:
        import plotly
        import plotly.graph_objects  # noqa: F401
    except ImportError:
        raise OomlessError(
            "`oomless report` draws its charts with plotly, which is not installed; "
            "install it with: pip install 'oomless[report]'"
        ) from None
    return plotly


from .data import ReportData, load_report_data  # noqa: E402
from .html import render_html, write_report  # noqa: E402

__all__ = ["ReportData", "load_report_data", "render_html", "require_plotly", "write_report"]
