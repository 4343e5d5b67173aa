"""plotly, the ``report`` extra: imported on first use, with a clear message when missing."""

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
