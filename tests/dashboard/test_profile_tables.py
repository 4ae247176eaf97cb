"""Profile tables with missing cells read the same under pandas 2 and 3 (pandas 3 keeps a missing value missing
where pandas 2's astype(str) wrote "nan"): kernel times count the rows of a table written before formats, and a
row without an option does not take the profile page down."""

from __future__ import annotations

import json
import os

import numpy as np
import pandas as pd
import pytest
from fastapi.testclient import TestClient

from dashboard.app import create_app
from tests.dashboard import synthetic


@pytest.mark.parametrize("suffix", ["parquet", "csv"])
def test_kind_times_count_rows_without_a_format(tmp_path, suffix):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    folder = tmp_path / "prof"
    synthetic.write_profile(folder, rng, 5, "0123456789abcdef", collectives=False)
    table = pd.read_parquet(folder / "profile.parquet")
    n = len(table)
    table["quantize_seconds"] = rng.uniform(1e-5, 1e-4, n)
    table["dequantize_seconds"] = rng.uniform(1e-5, 1e-4, n)
    table["recompute_seconds"] = np.where(table["option"] == "recompute", rng.uniform(1e-4, 1e-3, n), np.nan)
    # layers 0 and 3 come from a profile written before formats: their format cells are empty
    fmt = table["format"].astype(object)
    fmt[table["layer"].isin([0, 3])] = None
    table["format"] = fmt
    (folder / "profile.parquet").unlink()
    if suffix == "csv":
        table.to_csv(folder / "profile.csv", index=False)
    else:
        table.to_parquet(folder / "profile.parquet")
    meta = json.loads((folder / "profile.json").read_text())
    meta["files"] = {"table": f"profile.{suffix}"}
    (folder / "profile.json").write_text(json.dumps(meta))

    client = TestClient(create_app(tmp_path))
    times = client.get("/api/profile", params={"id": "prof"}).json()["times"]
    records = table.to_dict("records")
    for row in times["rows"]:
        for option in synthetic.OPTIONS[1:]:
            mine = [r for r in records if r["kind"] == row["kind"] and r["option"] == option]
            if option == "recompute":
                want = sum(r["recompute_seconds"] for r in mine) / len(mine)
            else:
                want = sum(r["quantize_seconds"] + r["dequantize_seconds"] for r in mine) / len(mine)
            assert row[option] == pytest.approx(want, rel=1e-12), (seed, row["kind"], option)
    assert len(times["rows"]) == len(synthetic.KINDS)


def test_a_row_without_an_option_does_not_break_the_maps(tmp_path):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    folder = tmp_path / "prof"
    synthetic.write_profile(folder, rng, 3, "0123456789abcdef", collectives=False)
    table = pd.read_parquet(folder / "profile.parquet")
    option = table["option"].astype(object)
    option[len(table) - 1] = None
    table["option"] = option
    table.to_parquet(folder / "profile.parquet")
    client = TestClient(create_app(tmp_path))
    r = client.get("/api/profile", params={"id": "prof"})
    assert r.status_code == 200
    maps = r.json()["maps"]
    assert maps["option"] == "4" and "4" in maps["options"], seed
    rows = table[table["option"] == "4"]
    for i, layer in enumerate(maps["layers"]):
        for j, kind in enumerate(maps["kinds"]):
            want = rows[(rows["layer"] == layer) & (rows["kind"] == kind)]["bytes"]
            assert maps["bytes"][i][j] == int(want.iloc[0])
    assert client.get("/profile", params={"id": "prof"}).status_code == 200
