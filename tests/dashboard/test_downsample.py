"""Min/max thinning against a brute-force reference on random series with spikes and NaN gaps."""

import numpy as np
import pytest

from dashboard.downsample import minmax_indices


@pytest.mark.parametrize("n, max_points", [(1, 4), (37, 37), (38, 37), (1013, 101), (100_003, 2000), (5000, 5)])
def test_minmax_keeps_each_buckets_extremes(n, max_points, seed):
    rng = np.random.default_rng(seed)
    y = rng.standard_normal(n).cumsum()
    spikes = rng.integers(0, n, size=max(1, n // 997))
    y[spikes] += rng.choice([-50.0, 50.0], size=len(spikes))
    if n > 100:
        y[rng.integers(0, n - 30):][:25] = np.nan
    idx = minmax_indices(y, max_points)
    assert len(idx) <= max(max_points, n if n <= max_points else 0)
    assert np.all(np.diff(idx) > 0) and idx[0] == 0 and idx[-1] == n - 1
    if n <= max_points:
        assert idx.tolist() == list(range(n))
        return
    buckets = (max_points - 2) // 2
    edges = np.linspace(0, n, buckets + 1).astype(int)
    kept = set(idx.tolist())
    for lo, hi in zip(edges[:-1], edges[1:]):
        part = y[lo:hi]
        if np.isnan(part).all():
            assert lo in kept
            continue
        # brute force: the positions of the bucket's smallest and largest finite value
        finite = [(v, lo + i) for i, v in enumerate(part) if not np.isnan(v)]
        assert min(finite)[1] in kept or y[min(finite)[1]] in y[[i for i in kept if lo <= i < hi]]
        assert max(finite)[1] in kept or y[max(finite)[1]] in y[[i for i in kept if lo <= i < hi]]
    finite_y = y[~np.isnan(y)]
    assert np.nanmin(y[idx]) == finite_y.min() and np.nanmax(y[idx]) == finite_y.max()


def test_too_few_points_refused():
    with pytest.raises(ValueError, match="max_points"):
        minmax_indices(np.zeros(10), 3)


def test_plan_bits_colours_recompute_apart_from_two_bits():
    """Recomputed kinds and checkpointed layers have no error: they sit past 16 on the scale, not at 2 bits."""
    import math

    from dashboard.figures import PLAN_EXACT_Z, plan_bits

    bits = {"bits": [[2, 0, 16], [-1, -1, -1], [5, None, 8]], "kinds": ["a", "b", "c"], "layers": [0, 1, 2],
            "stages": [0, 0, 0], "text": [["2", "R", "16"], ["ckpt"] * 3, ["5", "", "8"]]}
    fig = plan_bits(bits)
    trace = fig["data"][0]
    assert trace["z"] == [[1, PLAN_EXACT_Z, 4], [PLAN_EXACT_Z] * 3, [math.log2(5), None, 3]]  # log2 of the bits
    assert trace["zmin"] < 1 and trace["zmax"] > PLAN_EXACT_Z > 4
    # the colour at 2 bits differs from the colour of the recomputed cells
    scale = trace["colorscale"]
    assert scale[0][1] != scale[-1][1]


def test_pareto_chart_draws_the_budget_and_says_what_it_plots():
    from dashboard.figures import pareto_front

    rows = [{"plan": f"p{i}", "predicted_peak_bytes": 1000 * (i + 3), "predicted_step_seconds": 0.1 / (i + 1),
             "predicted_grad_error": 0.01 * i} for i in range(4)]
    chosen = {"predicted_peak_bytes": 5000, "predicted_step_seconds": 0.04, "budget_bytes": 5500}
    fig = pareto_front(rows, chosen)
    assert "memory/error Pareto front" in fig["layout"]["title"]["text"]
    lines = fig["layout"]["shapes"]
    assert len(lines) == 1 and lines[0]["x0"] == lines[0]["x1"] == 5500 / 1024  # KiB scale for these sizes
    assert any(t["name"].startswith("budget") for t in fig["data"])
    assert "shapes" not in pareto_front(rows, None)["layout"] or not pareto_front(rows, None)["layout"]["shapes"]


def test_smoothing_interpolation_and_the_loss_difference(seed):
    import random

    from dashboard.figures import _interp, run_color, run_curves, smooth

    rng = random.Random(seed)
    xs = [rng.random() for _ in range(37)]
    ema, acc = smooth(xs, 0.8), None
    for x, y in zip(xs, ema):  # by hand
        acc = x if acc is None else 0.8 * acc + 0.2 * x
        assert abs(y - acc) < 1e-12
    assert smooth([None, 1.0, float("nan"), 3.0], 0.5) == [None, 1.0, None, 2.0]
    assert _interp([0, 10, 20], [0.0, 1.0, 3.0], [-1, 0, 5, 15, 20, 21]) == [None, 0.0, 0.5, 2.0, 3.0, None]
    assert run_color("a/b") == run_color("a/b")

    def run(rid, loss):
        steps = list(range(1, len(loss) + 1))
        series = {name: {"step": steps, "elapsed_s": steps, "value": vals} for name, vals in
                  (("loss", loss), ("tokens_per_s", [1.0] * len(loss)), ("grad_norm", [0.5] * len(loss)),
                   ("step_seconds", [0.01] * len(loss)), ("lr", [1e-3] * len(loss)))}
        series["val_loss"] = {"step": [], "elapsed_s": [], "value": []}
        return {"id": rid, "curves": {"series": series, "peak_bytes": []}}

    base = [3.0 - 0.01 * i for i in range(50)]
    figs = run_curves([run("base", base), run("other", [v + 0.25 for v in base])])
    diff = figs[-1]
    assert "minus base" in diff["layout"]["title"]["text"]
    values = [v for v in diff["data"][0]["y"] if v is not None]
    assert values and all(abs(v - 0.25) < 1e-9 for v in values)  # a constant offset survives smoothing
    titles = [f["layout"]["title"]["text"] for f in figs]
    assert any("Gradient norm" in t for t in titles) and any("Learning rate" in t for t in titles)
    assert len(run_curves([run("base", base)])) == len(figs) - 1  # one run: no difference chart


def test_pareto_chart_draws_reference_steps_and_the_measured_choice():
    from dashboard.figures import pareto_front

    rows = [{"plan": "p", "predicted_peak_bytes": 4096, "predicted_step_seconds": 0.05, "predicted_grad_error": 0.1}]
    chosen = {"predicted_peak_bytes": 4096, "predicted_step_seconds": 0.05, "measured_peak_bytes": 4200,
              "measured_step_seconds": 0.045}
    refs = [{"name": "bf16", "peak_bytes": 8192, "step_seconds": 0.04},
            {"name": "agoq-paper", "peak_bytes": 3072, "step_seconds": 0.06}]
    names = {t["name"]: t for t in pareto_front(rows, chosen, refs)["data"]}
    assert names["profile's steps"]["text"] == ["bf16", "agoq-paper"]
    assert names["profile's steps"]["y"] == [40.0, 60.0]
    assert names["chosen plan, measured"]["y"] == [45.0]
