"""The search request's rules (agoq.search.request) against values worked out here, the request itself
(frozen, read from the command's words, checked however it is made), and InfeasibleBudget reaching the caller
typed, with the smallest budget that fits."""

from __future__ import annotations

import dataclasses
import os
import pickle
import random
import time
from decimal import ROUND_HALF_EVEN, Decimal

import pytest

from agoq.formats.profile import load_profile
from agoq.search.request import (
    MAX_BUDGET_BYTES,
    BadField,
    InfeasibleBudget,
    KnobSpace,
    SearchRequest,
    read_field,
)
from agoq.search.search import plan_from_profile, search
from agoq.units import parse_size
from tests.search.synthetic_profile import write_profile

UNITS = {"": 1, "B": 1, "kB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KiB": 2**10, "MiB": 2**20,
         "GiB": 2**30, "TiB": 2**40}


def fresh_rng():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    return random.Random(seed)


def test_budget_sizes_against_exact_arithmetic():
    rng = fresh_rng()
    for _ in range(500):
        unit = rng.choice(list(UNITS))
        whole, thousandths = rng.randrange(0, 900), rng.randrange(0, 1000)
        text = f"{whole}.{thousandths:03d}{rng.choice(['', ' '])}{unit}"
        exact = (Decimal(f"{whole}.{thousandths:03d}") * UNITS[unit]).to_integral_value(ROUND_HALF_EVEN)
        if 0 < exact <= MAX_BUDGET_BYTES:  # read through a float: exact to the byte below 4 GiB, within one above
            assert abs(read_field("budget", text) - int(exact)) <= (0 if exact < 2**32 else 1), text
        else:
            with pytest.raises(BadField, match="more than 0" if exact <= 0 else "more than any GPU"):
                read_field("budget", text)


def test_budget_limits_alike_as_text_and_number():
    rng = fresh_rng()
    for value in [1, MAX_BUDGET_BYTES] + [rng.randrange(1, MAX_BUDGET_BYTES) for _ in range(50)]:
        assert read_field("budget", value) == read_field("budget", str(value)) == value
        assert read_field("budget", float(value)) == round(float(value))
    for value in [0, -1, MAX_BUDGET_BYTES + 1, -rng.randrange(1, 10**9), MAX_BUDGET_BYTES + rng.randrange(1, 10**15)]:
        for given in (value, str(value), float(value)):
            with pytest.raises(BadField) as e:
                read_field("budget", given)
            assert e.value.field == "budget" and ("more than 0" in e.value.problem) == (value <= 0)
    for bad in [float("nan"), float("inf"), True, None, [1], "1e400", "", "GiB", "1.", "-0"]:
        with pytest.raises(BadField):
            read_field("budget", bad)


def test_sizes_are_read_in_linear_time():
    """The size pattern has one way to match any text: long inputs that fail late fail fast (an ambiguous
    pattern took 13 s at 16,000 digits, with the dashboard's event loop waiting)."""
    n = 30_000 + fresh_rng().randrange(1000)
    for text in ["7" * n + "!", "1" + " " * n + "!", "." + "5" * n + "e", "1e" + "3" * n + "?", "9" * n + "GiBs"]:
        start = time.monotonic()
        with pytest.raises(ValueError) as e:
            parse_size(text)
        assert time.monotonic() - start < 1.0
        assert len(str(e.value)) < 300  # quoted as an excerpt


def test_caps():
    rng = fresh_rng()
    for _ in range(200):
        x = rng.uniform(-5, 5) * 10 ** rng.randrange(-6, 6)
        for field, ok in (("time_cap", x > 0), ("error_cap", x >= 0)):
            for given in (x, repr(x)):
                if ok:
                    assert read_field(field, given) == x
                else:
                    with pytest.raises(BadField, match=">=? 0"):
                        read_field(field, given)
    assert read_field("error_cap", 0) == 0.0 and read_field("error_cap", "0") == 0.0
    for field, word, other in (("time_cap", "checkpoint", "recipe"), ("error_cap", "recipe", "checkpoint")):
        assert read_field(field, word) == word
        assert read_field(field, "none") is None and read_field(field, None) is None
        for bad in (other, "inf", "-inf", "nan", float("inf"), True, [0.1], "0.1s"):
            with pytest.raises(BadField) as e:
                read_field(field, bad)
            assert e.value.field == field


def test_request_is_checked_however_it_is_made():
    rng = fresh_rng()
    budget = rng.randrange(1, 10**11)
    request = SearchRequest(budget)
    assert hash(request) == hash(SearchRequest(budget)) and request == SearchRequest(budget)
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.budget = 5
    for change, field in [({"budget": 0}, "budget"), ({"objective": "speed"}, "objective"),
                          ({"time_cap": -1.0}, "time_cap"), ({"method": "grid"}, "method"), ({"trials": 0}, "trials"),
                          ({"front_budgets": -1}, "front_budgets"), ({"space": "any"}, "space")]:
        for make in (lambda: SearchRequest.of(request, change), lambda: SearchRequest(**{"budget": budget, **change})):
            with pytest.raises(BadField) as e:
                make()
            assert e.value.field == field
    assert SearchRequest.of(budget, {"time_cap": "2.5"}).time_cap == 2.5
    assert SearchRequest.of(request, {}) is request


def test_read_from_the_commands_words():
    """The words of `agoq search`'s flags (argparse's defaults included) make the request its flags describe."""
    defaults = {"budget": "3GiB", "method": None, "objective": "time", "time_cap": None, "error_cap": "recipe",
                "gradients": "any", "layout": "any", "optimizer": "any", "master": "fp32", "compile": "any",
                "global_batch": None, "micro_batch": None, "trials": None, "sampler": "nsga2", "seed": 0,
                "front_budgets": 8, "validate": 0, "validate_steps": 4, "measure_trials": False}
    assert SearchRequest.read(defaults) == SearchRequest(3 * 2**30)
    words = {**defaults, "gradients": "quangrad8", "layout": "fsdp", "optimizer": "adamw8bit", "master": "any",
             "compile": "compiled", "global_batch": "12", "micro_batch": "3", "trials": "9", "error_cap": "none"}
    request = SearchRequest.read(words)
    assert request.space == KnobSpace(gradient_modes=("quangrad8",), layouts=("fsdp",), optimizers=("adamw8bit",),
                                      masters=("fp32", "none"), compile_modes=("compiled",), global_batch=12,
                                      micro_batches=(3,))
    assert (request.method, request.trials, request.error_cap) == ("both", 9, None)
    assert SearchRequest.read({**words, "method": "optuna"}).method == "optuna"
    with pytest.raises(BadField) as e:
        SearchRequest.read({**defaults, "layout": "ring"})
    assert e.value.field == "layout" and "ring" in e.value.problem


def test_offload_and_host_budget_words():
    """Offload on/off and the host budget are read alike from the command line's words and JSON's values; bad ones
    are refused naming the field."""
    rng = random.Random()
    gb = rng.uniform(0.5, 500)
    for offload, expected in (("off", False), ("on", True), (False, False), (True, True), ("OFF", False)):
        request = SearchRequest.read({"budget": "3GiB", "offload": offload, "host_budget": f"{gb}GB"})
        assert request.space.offload is expected
        assert request.space.host_budget == parse_size(f"{gb}GB")
    assert SearchRequest.read({"budget": "3GiB", "host_budget": None}).space.host_budget is None
    assert SearchRequest.read({"budget": "3GiB"}).space == KnobSpace()  # offload on, the profile's pinnable bytes
    for field, value in (("offload", "maybe"), ("offload", 1), ("host_budget", "-2GB"), ("host_budget", "lots"),
                         ("host_budget", 0)):
        with pytest.raises(BadField) as e:
            SearchRequest.read({"budget": "3GiB", field: value})
        assert e.value.field == field


def test_attention_is_kept_unless_asked_for(tmp_path):
    """Attention's quantized options are offered only with quantize_attention on (off by default, read from words
    and JSON alike): off, the search's problems have no attention option but 16 and its plans keep attention at 16
    bits at every budget; on, every measured option is back."""
    from agoq.runtime.activations.policy import KINDS
    from agoq.search.costs import build_problem
    from agoq.search.knobs import budget_bounds, combinations

    for value, expected in (("on", True), ("off", False), (True, True), (False, False)):
        assert SearchRequest.read({"budget": "3GiB", "quantize_attention": value}).space.quantize_attention is expected
    assert SearchRequest.read({"budget": "3GiB"}).space.quantize_attention is False
    with pytest.raises(BadField) as e:
        SearchRequest.read({"budget": "3GiB", "quantize_attention": "sometimes"})
    assert e.value.field == "quantize_attention"
    rng = random.Random()
    profile = load_profile(write_profile(tmp_path / "p", rng, num_layers=rng.choice([3, 5])))
    table = profile.table
    measured = set(table.loc[table["kind"] == "attention", "option"])
    assert measured - {"16"}, "the synthetic profile measures attention at some bit width"
    for on in (False, True):
        for knobs in combinations(profile, KnobSpace(quantize_attention=on)):
            p = build_problem(profile, knobs)
            att = {p.option[i] for i in range(len(p.option)) if p.kind[i] == KINDS.index("attention")}
            assert att == (measured if on else {"16"}), (on, att)
    least, largest = budget_bounds(profile)
    for budget in (least * 1.05, (least + largest) / 2):
        try:
            plan = plan_from_profile(profile, int(budget))
        except InfeasibleBudget:
            continue
        assert all(lp.kinds.get("attention", 16) == 16 for lp in plan.layers)


def test_infeasible_budget_words_and_pickles():
    e = InfeasibleBudget("no choice fits", 4096)
    assert e.advice() == "no choice fits: give budget 4096 or more"
    assert e.advice(lambda f: "--" + f.replace("_", "-")) == "no choice fits: give --budget 4096 or more"
    caps = InfeasibleBudget("nothing meets the caps", None, ("time_cap", "error_cap"))
    assert caps.advice() == "nothing meets the caps: raise time_cap or error_cap"
    back = pickle.loads(pickle.dumps(caps))  # across processes (Ray, the planner's pools)
    assert (back.smallest_budget, back.caps, str(back)) == (None, ("time_cap", "error_cap"), str(caps))


def test_search_raises_infeasible_budget_typed(tmp_path):
    """Below the least budget any plan fits, search and plan_from_profile raise InfeasibleBudget with that budget:
    a plan fits it, none a byte less."""
    profile = load_profile(write_profile(tmp_path / "p", fresh_rng(), micro_batch=2, seq_len=23))
    request = SearchRequest(10**3, error_cap=None, front_budgets=0)
    with pytest.raises(InfeasibleBudget) as e:
        search(profile, request, progress=False)
    least = e.value.smallest_budget
    assert isinstance(least, int) and least > 10**3 and str(least) in str(e.value)
    plan = search(profile, request, budget=least, progress=False).plan
    assert max(plan.predicted.peak_bytes_per_stage) <= least
    with pytest.raises(InfeasibleBudget) as again:
        plan_from_profile(profile, least - 1, error_cap=None)
    assert again.value.smallest_budget == least
