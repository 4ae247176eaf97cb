"""The HTML building blocks of the dashboard's pages: escaping and number formats, links between pages, message
boxes, tables, and `Page`, which collects a page's sections and its Plotly figures (embedded as JSON, drawn by
static/dashboard.js with the Plotly bundle the app serves itself)."""

from __future__ import annotations

import datetime as dt
import html
import json
from typing import Any, Iterable
from urllib.parse import urlencode


def esc(value: Any) -> str:
    """Text made safe for HTML."""
    return html.escape("" if value is None else str(value))


def fmt_num(x: Any, digits: int = 4) -> str:
    """A number with `digits` significant digits, or an en dash when unknown."""
    if x is None:
        return "–"
    if isinstance(x, (int, float)):
        return f"{x:.{digits}g}" if isinstance(x, float) else str(x)
    return esc(x)


def fmt_seconds(x: Any) -> str:
    """Seconds shown in ms below one second."""
    if x is None:
        return "–"
    return f"{x * 1e3:.2f} ms" if x < 1 else f"{x:.2f} s"


def fmt_time(epoch: float) -> str:
    """An epoch time as UTC."""
    return dt.datetime.fromtimestamp(epoch, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def link(path: str, **params: Any) -> str:
    """A URL to one of the dashboard's pages with query parameters (ids stay readable)."""
    pairs = []
    for key, value in params.items():
        for v in (value if isinstance(value, (list, tuple)) else [value]):
            if v is not None:
                pairs.append((key, v))
    return path + ("?" + urlencode(pairs, safe="/") if pairs else "")


def message(text: str, kind: str = "info") -> str:
    """A message box (info, empty, warn: a run that ran but missed its plan, or error)."""
    return f'<div class="msg {kind}">{esc(text)}</div>'


class Page:
    """One page being built: HTML sections and the figures they reference."""

    def __init__(self, title: str):
        self.title = title
        self.parts: list[str] = []
        self.figures: list[dict[str, Any]] = []
        self.refresh_seconds: int | None = None
        self.scripts: list[str] = []  # more of the app's own scripts (/static/NAME) this page runs

    def add(self, text: str) -> None:
        self.parts.append(text)

    def figure(self, fig: dict[str, Any] | None) -> None:
        """Add a chart (nothing when `fig` is None)."""
        if fig is None:
            return
        n = len(self.figures)
        self.figures.append(fig)
        self.add(f'<div class="plot" id="plot-{n}" data-figure="figure-{n}"></div>')

    def error_or(self, data: Any, what: str) -> bool:
        """Show data's error (or its empty state) as a message and return False; True when there is
        neither."""
        if isinstance(data, dict) and len(data) == 1 and "error" in data:
            self.add(message(f"{what}: {data['error']}", "error"))
            return False
        if isinstance(data, dict) and len(data) == 1 and "empty" in data:
            self.add(message(data["empty"], "empty"))
            return False
        return True

    def render(self) -> str:
        scripts = []
        for n, fig in enumerate(self.figures):
            payload = json.dumps(fig, allow_nan=False).replace("<", "\\u003c").replace(">", "\\u003e") \
                .replace("&", "\\u0026")
            scripts.append(f'<script type="application/json" id="figure-{n}">{payload}</script>')
        refresh = (f'<meta http-equiv="refresh" content="{self.refresh_seconds}">'
                   if self.refresh_seconds else "")
        return (
            "<!doctype html><html lang=en><head><meta charset=utf-8>"
            f"<meta name=viewport content='width=device-width, initial-scale=1'>{refresh}"
            f"<title>agoq · {esc(self.title)}</title>"
            '<link rel="stylesheet" href="/static/dashboard.css">'
            '<script src="/static/plotly.min.js"></script><script src="/static/dashboard.js" defer></script>'
            + "".join(f'<script src="/static/{esc(name)}" defer></script>' for name in self.scripts) +
            "</head><body><header><nav><a href='/'>overview</a><a href='/runs'>runs</a>"
            "<a href='/docs'>API</a></nav>"
            f"<h1>{esc(self.title)}</h1></header><main>{''.join(self.parts)}</main>{''.join(scripts)}</body></html>"
        )


def table(headers: Iterable[str], rows: Iterable[Iterable[str]], empty: str = "") -> str:
    """An HTML table from already-escaped cells."""
    rows = list(rows)
    if not rows:
        return message(empty, "empty") if empty else ""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<div class=scroll><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"


def column_label(name: str) -> str:
    """A readable header for a pareto.csv column: words instead of the field name, the unit said once
    (bytes are shown in binary units, seconds as ms or s)."""
    words = name.replace("_bytes", "").replace("_seconds", " time").replace("grad_error", "gradient error")
    words = words.replace("_", " ").strip()
    return words[:1].upper() + words[1:]


def error_row(entry: dict[str, Any], href: str, width: int) -> list[str]:
    return [f'<a href="{esc(href)}">{esc(entry["id"])}</a>', f'<span class="bad">{esc(entry["error"])}</span>'] \
        + [""] * (width - 2)
