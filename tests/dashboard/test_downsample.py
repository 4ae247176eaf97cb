"""Min/max thinning against a brute-force reference on random series with spikes and NaN gaps."""

import numpy as np
import pytest

from dashboard.downsample import minmax_indices


@pytest.mark.parametrize("n, max_points", [(1, 4), (37, 37), (38, 37), (1013, 101), (100_003, 2000), (5000, 5)])
def test_minmax_keeps_each_buckets_extremes(n, max_points):
    rng = np.random.default_rng()
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
    from dashboard.figures import PLAN_EXACT_Z, plan_bits

    bits = {"bits": [[2, 0, 16], [-1, -1, -1], [5, None, 8]], "kinds": ["a", "b", "c"], "layers": [0, 1, 2],
            "stages": [0, 0, 0], "text": [["2", "R", "16"], ["ckpt"] * 3, ["5", "", "8"]]}
    fig = plan_bits(bits)
    trace = fig["data"][0]
    assert trace["z"] == [[2, PLAN_EXACT_Z, 16], [PLAN_EXACT_Z] * 3, [5, None, 8]]
    assert trace["zmin"] == 2 and trace["zmax"] == PLAN_EXACT_Z
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
