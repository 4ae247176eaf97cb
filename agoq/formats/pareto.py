"""The Pareto CSV a search writes beside its plan (OUT_STEM.pareto.csv; docs/formats.md "Plan"): one row per plan of
the front, MILP and Optuna. `pareto_csv` is its only writer (agoq.search.outputs writes the text it makes) and
`read_pareto` its only reader. Light: the csv module only."""

from __future__ import annotations

import csv
import io
import math
import os
from pathlib import Path
from typing import Any

from agoq.formats.schema import FormatError

COLUMNS = ["source", "trial", "budget_bytes", "predicted_peak_bytes", "predicted_step_seconds",
           "predicted_grad_error", "block", "format", "gradient_mode", "micro_batch", "grad_accum",
           "floors", "plan", "measured_peak_bytes", "measured_step_seconds", "measured_loss_deviation"]
REQUIRED = ("predicted_peak_bytes", "predicted_step_seconds", "predicted_grad_error")  # what a reader cannot do without
MAX_CSV_BYTES = 64 * 2**20  # a front of hundreds of plans is a few hundred KiB


def pareto_csv(rows: list[dict[str, Any]]) -> str:
    """The CSV text of `rows` (dicts keyed by COLUMNS): a missing value (None, NaN) as an empty cell."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS)
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if v is None or (isinstance(v, float) and math.isnan(v)) else v)
                         for k, v in row.items()})
    return buf.getvalue()


def _cell(value: str | None) -> Any:
    """A cell as a finite float when it is one, None when empty or not finite ("", "nan", "inf"), else its text."""
    if value is None or value == "":
        return None
    try:
        x = float(value)
    except ValueError:
        return value
    return x if math.isfinite(x) else None


def read_pareto(path: str | os.PathLike, where: str | None = None) -> dict[str, Any]:
    """{"columns": the header in file order, "rows": one dict per row, numbers as floats (empty and non-finite
    cells None), text kept}; FormatError naming the file (as `where` gives it, default its path) when it cannot be
    read, is larger than MAX_CSV_BYTES (refused unread) or lacks one of REQUIRED's columns. Columns it does not know
    are kept (the format grows additively)."""
    p = Path(path)
    where = str(p) if where is None else where
    try:
        size = p.stat().st_size
        if size > MAX_CSV_BYTES:
            raise FormatError(f"{where}: {size / 2**20:.1f} MiB, larger than the {MAX_CSV_BYTES // 2**20} MiB agoq "
                              "reads for a Pareto CSV; not read")
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise FormatError(f"{where}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    reader = csv.DictReader(io.StringIO(text))
    columns = list(reader.fieldnames or [])
    missing = [c for c in REQUIRED if c not in columns]
    if missing:
        raise FormatError(f"{where}: missing column(s) {', '.join(missing)}; a Pareto CSV written by `agoq search` "
                          "has them")
    rows = [{key: _cell(value) for key, value in raw.items() if key is not None} for raw in reader]
    return {"columns": columns, "rows": rows}
