"""A matplotlib figure as an SVG element to inline in an HTML page (verify's and bench's
reports)."""

from __future__ import annotations

import io
from typing import Any


def figure_svg(fig: Any, salt: str) -> str:
    """`fig` as one <svg> element: text as <text> (small, selectable); `salt` keeps the ids of
    the page's plots apart, one salt per plot; no metadata block, so the page holds no URLs but
    the SVG namespaces and is the same bytes for the same figure."""
    import matplotlib

    buf = io.StringIO()
    no_metadata = dict.fromkeys(("Creator", "Date", "Format", "Type"))
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": salt}):
        fig.savefig(buf, format="svg", bbox_inches="tight", metadata=no_metadata)
    svg = buf.getvalue()
    return svg[svg.index("<svg") :]
