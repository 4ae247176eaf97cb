"""HTML pages over the dashboard's data: tables of key figures and Plotly charts (the building blocks:
dashboard.markup)."""

from __future__ import annotations

import json
from typing import Any

from dashboard import cluster, figures
from dashboard.origins import overview_note
from dashboard.formats import format_bytes as fmt_bytes
from dashboard.markup import (Page, column_label, error_row, esc, fmt_num, fmt_seconds, fmt_time, link,
                              message, table)


# --- pages ------------------------------------------------------------------------------------------

def overview(data: dict[str, Any]) -> str:
    """The overview: everything found under the root, with key figures."""
    page = Page("overview")
    page.add(f"<p class=meta>root <code>{esc(data['root'])}</code>, scanned {esc(fmt_time(data['scanned_at']))} "
             "(new folders show up on reload) · <a href='/?refresh=1'>rescan now</a></p>")
    counts = {k: len(data[k]) for k in ("profiles", "searches", "plans", "runs")}
    page.add("<div class=cards>" + "".join(f"<div class=card><b>{n}</b>{k}</div>" for k, n in counts.items())
             + "</div>")
    page.add(overview_note(data))
    if not any(counts.values()):
        page.add(message("Nothing found under this root yet. Run `agoq demo --out DIR` (or `agoq profile`, "
                         "`agoq search`, `agoq train` with --out under this folder), then reload.", "empty"))

    page.add("<h2>Profiles</h2>")
    rows = []
    for p in data["profiles"]:
        href = link("/profile", id=p["id"])
        if "error" in p:
            rows.append(error_row(p, href, 7))
            continue
        rows.append([f'<a href="{esc(href)}">{esc(p["id"])}</a>', esc(p["model"]), fmt_num(p["num_layers"]),
                     fmt_num(p["parameters"]), device_cell(p),
                     esc(p["date"]), fmt_num(len(p["failures"]))])
    page.add(table(["profile", "model", "layers", "parameters", "device", "date", "failures"], rows,
                   "No profiles yet (agoq profile MODEL --out DIR)."))

    page.add("<h2>Searches</h2>")
    rows = []
    for s in data["searches"]:
        href = link("/search", id=s["id"])
        if "error" in s:
            rows.append(error_row(s, href, 7))
            continue
        warn = "".join(f'<br><span class="bad">{esc(p)}</span>' for p in s.get("problems") or [])
        rows.append([f'<a href="{esc(href)}">{esc(s["id"])}</a>{warn}', fmt_num(s["pareto_plans"]), fmt_num(s["validated"]),
                     fmt_bytes(s["budget_bytes"]), fmt_bytes(s["lowest_peak_bytes"]), esc(s["chosen_plan"]),
                     esc(s["study"])])
    page.add(table(["search", "Pareto plans", "validated", "budget", "lowest predicted peak", "chosen plan",
                    "Optuna study"], rows, "No searches yet (agoq search --profile DIR --budget SIZE --out DIR)."))

    page.add("<h2>Plans</h2>")
    rows = []
    front = [p for p in data["plans"] if p.get("search") is not None and not p.get("chosen")]
    for p in data["plans"]:
        if p in front:
            continue
        href = link("/plan", id=p["id"])
        if "error" in p:
            rows.append(error_row(p, href, 9))
            continue
        rows.append([f'<a href="{esc(href)}">{esc(p["id"])}</a>', esc(p["model"]), fmt_bytes(p["budget_bytes"]),
                     esc(cluster.layout_cell(p.get("layout"))),
                     fmt_bytes(p["predicted_peak_bytes"]), fmt_seconds(p["predicted_step_seconds"]),
                     fmt_num(p["predicted_grad_error"]), measured_peak(p),
                     esc(p["method"])])
    page.add(table(["plan", "model", "budget", "layout", "predicted peak", "predicted step", "grad error",
                    "measured peak", "method"], rows, "No plans yet."))
    if front:
        page.add(f"<p class=meta>{len(front)} more plan(s) of searches' Pareto fronts are linked from their "
                 "search pages.</p>")

    page.add("<h2>Runs</h2>")
    page.add(run_table(data["runs"], selected=set()))
    if data["problems"]:
        page.add("<h2>Skipped</h2>" + "".join(message(p, "error") for p in data["problems"]))
    return page.render()


def device_cell(profile: dict[str, Any]) -> str:
    """A profile's device on the overview: the GPU's name, or the machine's name marked as the CPU."""
    name = str(profile.get("device") or "")
    cpu = profile.get("hardware_device") == "cpu" and name.lower() != "cpu"
    return esc(name) + (" (CPU)" if cpu else "")


def measured_peak(plan: dict[str, Any]) -> str:
    """A plan's measured peak on the overview: "no" when it never ran, "step time only (CPU)" when it ran where
    peaks are not measured."""
    if not plan["validated"]:
        return "no"
    if plan.get("measured_peak_bytes") is None and plan.get("measured_device") == "cpu":
        return "step time only (CPU)"
    return fmt_bytes(plan.get("measured_peak_bytes"))


def run_table(items: list[dict[str, Any]], selected: set[str], x: str = "step") -> str:
    """The run picker: a table of runs with checkboxes, submitted to the runs page."""
    rows = []
    for r in items:
        box = (f'<input type=checkbox name=id value="{esc(r["id"])}"' + (" checked" if r["id"] in selected else "")
               + ">")
        href = link("/runs", id=r["id"])
        if "error" in r:
            rows.append([box] + error_row(r, href, 9))
            continue
        rows.append([box, f'<a href="{esc(href)}">{esc(r["id"])}</a>', esc(r["model"]), esc(r["plan"]),
                     esc(r["status"]) + (f' <span class=bad>{esc(r["message"])}</span>' if r.get("message") else ""),
                     f'{fmt_num(r["step"])} / {fmt_num(r["steps"])}', fmt_num(r["last_loss"]),
                     fmt_num(r["last_val_loss"]), fmt_num(r["median_tokens_per_s"], 5), fmt_bytes(r["max_peak_bytes"])])
    if not rows:
        return message("No runs yet (agoq train MODEL --out DIR).", "empty")
    return ("<form method=get action='/runs'>" +
            table(["", "run", "model", "plan", "status", "step", "loss", "val loss", "tokens/s", "peak"], rows)
            + f"<input type=hidden name=x value={esc(x)}><button type=submit>compare selected runs</button></form>")


def profile(data: dict[str, Any], start: dict[str, Any] | None = None) -> str:
    """A profile: key figures, heat maps, error curves, collective times; its live plan starts from `start`
    (Dashboard.planner_start: the settings of the plan made from it, or None)."""
    s = data["summary"]
    page = Page(f"profile {data['id']}")
    settings = s.get("settings") or {}
    page.add(table(["model", "fingerprint", "layers", "parameters", "device", "micro-batch", "seq", "date"],
                   [[esc(s["model"]), f"<code>{esc(s['fingerprint'])}</code>", fmt_num(s["num_layers"]),
                     fmt_num(s["parameters"]), esc(s["device"]), fmt_num(settings.get("micro_batch")),
                     fmt_num(settings.get("seq_len")), esc(s["date"])]]))
    planner_section(page, data["id"], start)
    page.add(f'<p><a href="{esc(link("/whatif", id=data["id"]))}">what-if: plans for clusters this profile was not '
             'measured on</a></p>')
    steps = (s.get("memory") or {}).get("steps") or []
    if steps:
        page.add("<h2>Measured steps</h2>")
        page.add(table(["policy", "measured peak", "predicted peak", "step time"],
                       [[esc(st.get("policy")), fmt_bytes(st.get("measured_peak_bytes")),
                         fmt_bytes(st.get("predicted_peak_bytes")), fmt_seconds(st.get("step_seconds"))]
                        for st in steps]))
    for note in (s.get("memory") or {}).get("notes") or []:
        page.add(message(str(note), "info"))
    if data.get("layout_steps"):
        page.add(cluster.render_steps(data["layout_steps"]))
    for f in s.get("failures") or []:
        page.add(message(f"{f.get('what')}: {f.get('error')}", "error"))
    maps = data["maps"]
    page.add("<h2>Per layer and kind</h2>")
    if page.error_or(maps, "profile.parquet"):
        page.add("<p class=options>option: " + " ".join(
            f'<a href="{esc(link("/profile", id=data["id"], option=o))}"' + (" class=on" if o == maps["option"] else "")
            + f">{esc(o)}</a>" for o in maps["options"]) + "</p>")
        for fig in figures.profile_maps(maps):
            page.figure(fig)
    times = data.get("times") or {}
    if isinstance(times, dict) and times.get("rows"):
        page.add("<h2>Time each option adds, mean over layers</h2>")
        page.add("<p>quantize + dequantize per bit width (int format), recompute: the extra time in one step</p>")
        opts = times["options"]
        page.add(table(["kind"] + [("recompute" if o == "recompute" else f"{o} bits") for o in opts],
                       [[esc(r["kind"])] + [fmt_seconds(r.get(o)) for o in opts] for r in times["rows"]]))
    page.add("<h2>Error vs bit width</h2>")
    if page.error_or(data["curves"], "profile.parquet"):
        if data["curves"]["curves"]:
            for fig in figures.error_curves(data["curves"]["curves"]):
                page.figure(fig)
        else:
            page.add(message("no quantized options in this profile", "empty"))
    page.add("<h2>Collectives</h2>")
    coll = data["collectives"]
    if page.error_or(coll, "collectives.parquet"):
        if coll["series"]:
            for fig in figures.collective_times(coll["series"]):
                page.figure(fig)
        else:
            page.add(message(coll["message"], "empty"))
    return page.render()


def planner_section(page: Page, profile_id: str, start: dict[str, Any] | None = None) -> None:
    """The live plan of a profile (static/planner.js fills it in): a budget slider whose plan, solved by
    POST /api/plan as it moves, is drawn as the plan page draws a plan, and a button saving it. With `start` (the
    settings of a plan made from this profile) the slider starts at that plan's budget, objective, error cap,
    layout and gradient storage, and says so."""
    from agoq.search.request import GRADIENTS, LAYOUTS

    page.scripts.append("planner.js")

    def choices(name: str, words: tuple) -> str:
        return (f'<label>{name} <select id="plan-{name}" disabled>'
                + "".join(f'<option value="{w}">{w}</option>' for w in words) + "</select></label>")

    starting = ""
    if start:
        said = ", ".join(f"budget {fmt_bytes(v)}" if k == "budget_bytes" else f"{k.replace('_', ' ')} {v}"
                         for k, v in start.items() if k != "plan" and v is not None)
        starting = (f'<p class=meta id="plan-start-note">Starting from <a href="{esc(link("/plan", id=start["plan"]))}">'
                    f"{esc(start['plan'])}</a>'s own settings ({esc(said)}), so the first plan is laid out as that "
                    "one; change them below.</p>")
    page.add(
        "<h2>Plan at a budget</h2>"
        f'<div id="planner" data-profile="{esc(profile_id)}" data-start="{esc(json.dumps(start or {}))}">'
        '<p class=meta>The plan <code>agoq search</code> gives this profile at the budget below, solved as the slider '
        "moves (objective, caps, layout and gradients: the command's defaults unless chosen here).</p>" + starting +
        '<div class=planner-controls><label>budget per GPU <input type=range id="plan-budget" min=0 max=1000 step=1 '
        'value=500 disabled></label> <output id="plan-budget-text">–</output>'
        '<label>objective <select id="plan-objective" disabled></select></label>'
        + choices("layout", LAYOUTS) + choices("gradients", GRADIENTS) + '</div>'
        '<div id="plan-status" class="msg info">reading the budgets this profile can be planned at…</div>'
        '<div id="plan-result" hidden>'
        '<div id="plan-figures"></div><div id="plan-alternative"></div>'
        '<div class="live-plot" id="plan-bits"></div><div class="live-plot" id="plan-memory"></div>'
        '<p><label>save as ROOT/plans/<input id="plan-name" size=36></label> '
        '<button type=button id="plan-save">save plan</button> <span id="plan-saved"></span></p>'
        "</div></div>")


def _plan_sections(page: Page, data: dict[str, Any]) -> None:
    s = data["summary"]
    bf16 = s.get("bf16_predicted_peak_bytes")
    versus = (f" ({s['predicted_peak_bytes'] / bf16:.0%} of bf16's {fmt_bytes(bf16)})"
              if bf16 and s.get("predicted_peak_bytes") else "")
    page.add(table(["model", "budget", "gradients", "stages", "predicted peak", "measured peak",
                    "predicted step", "measured step", "grad error", "method", "profiled on"],
                   [[esc(s["model"]), fmt_bytes(s["budget_bytes"]), esc(s["gradients"]), fmt_num(s["stages"]),
                     fmt_bytes(s["predicted_peak_bytes"]) + esc(versus), fmt_bytes(s["measured_peak_bytes"]),
                     fmt_seconds(s["predicted_step_seconds"]), fmt_seconds(s["measured_step_seconds"]),
                     fmt_num(s["predicted_grad_error"]), esc(s["method"]), esc(s.get("profiled_on") or "-")]]))
    for note in s.get("notes") or []:
        page.add(message(note, "info"))
    if page.error_or(data["bits"], "plan layers"):
        page.figure(figures.plan_bits(data["bits"]))
    mem = data["memory"]
    if page.error_or(mem, "memory breakdown"):
        if not mem["parts_recorded"]:
            page.add(message("This plan records no parts of its predicted peak (plans written before schema "
                             "agoq.plan/1.2): search again to see what the peak is made of.", "info"))
        if mem.get("cpu_runs"):
            page.add(message("Not compared with the prediction: " + ", ".join(mem["cpu_runs"]) + " ran on the CPU, "
                             "where the recorded peak is the whole process's memory.", "info"))
        page.figure(figures.memory_breakdown(mem))
        parts = mem["predicted_parts"]
        measured = mem["measured_peak"]
        phases = mem.get("phases") or [None] * len(mem["stages"])
        page.add(table(["stage", "peak at", *(f"predicted {k.replace('_', ' ')}" for k in parts), "predicted peak",
                        *(f"measured ({k})" for k in measured)],
                       [[str(st), esc(figures.phase_label(phases[i])), *(fmt_bytes(v[i]) for v in parts.values()),
                         fmt_bytes(mem["predicted_peak"][i] if i < len(mem["predicted_peak"]) else None),
                         *(fmt_bytes(v[i] if i < len(v) else None) for v in measured.values())]
                        for i, st in enumerate(mem["stages"])]))
    page.add(cluster.render(data.get("cluster")))
    if data["runs"]:
        page.add("<p>Trained with this plan: " + ", ".join(
            f'<a href="{esc(link("/runs", id=r))}">{esc(r)}</a>' for r in data["runs"]) + "</p>")


def plan(data: dict[str, Any]) -> str:
    """A plan: key figures, bit-width map, memory breakdown."""
    page = Page(f"plan {data['id']}")
    _plan_sections(page, data)
    return page.render()


def search(data: dict[str, Any]) -> str:
    """A search: Pareto front, chosen plan, Optuna study."""
    page = Page(f"search {data['id']}")
    pareto = data["pareto"]
    page.add("<h2>Pareto front</h2>")
    if page.error_or(pareto, "pareto.csv"):
        if pareto["rows"]:
            chosen = data["chosen_plan"].get("summary") if isinstance(data["chosen_plan"], dict) else None
            page.figure(figures.pareto_front(pareto["rows"], chosen, data.get("references")))
            cols = [c for c in pareto["columns"] if c and any(r.get(c) is not None for r in pareto["rows"])]

            def cell(row: dict[str, Any], col: str) -> str:
                if col == "plan" and row.get("plan_id"):
                    return f'<a href="{esc(link("/plan", id=row["plan_id"]))}">{esc(row["plan"])}</a>'
                if col.endswith("_bytes"):
                    return fmt_bytes(row.get(col))
                return fmt_seconds(row.get(col)) if col.endswith("_seconds") else fmt_num(row.get(col))

            page.add(table([column_label(c) for c in cols], [[cell(r, c) for c in cols] for r in pareto["rows"]]))
        else:
            page.add(message(pareto["message"], "empty"))
    page.add("<h2>Chosen plan</h2>")
    chosen = data["chosen_plan"]
    if page.error_or(chosen, "chosen plan"):
        page.add(f'<p><a href="{esc(link("/plan", id=chosen["id"]))}">{esc(chosen["id"])}</a></p>')
        _plan_sections(page, chosen)
    page.add("<h2>Optuna study</h2>")
    study = data["study"]
    if page.error_or(study, "study"):
        if not study["studies"]:
            page.add(message(f"{study['file']} holds no study", "empty"))
        for st in study["studies"]:
            states = ", ".join(f"{k.lower()} {v}" for k, v in sorted(st["states"].items()))
            page.add(f"<p>{esc(study['file'])}: study <b>{esc(st['name'])}</b>, "
                     f"{esc(', '.join(st['directions']))}; trials: {esc(states) or 'none'}</p>")
            fig = figures.study_trials(st)
            if fig is None:
                page.add(message("no finished trials", "empty"))
            page.figure(fig)
    return page.render()


def runs(all_runs: list[dict[str, Any]], chosen: list[dict[str, Any]], selected: list[str],
         errors: list[str], x: str = "step") -> str:
    """The runs page: the picker, then the chosen runs' curves overlaid against step or time."""
    page = Page("runs")
    for e in errors:
        page.add(message(e, "error"))
    page.add(run_table(all_runs, set(selected), x))
    with_points = [c for c in chosen if c["curves"]["train_points"] or c["curves"]["val_points"]]
    if with_points:
        page.add("<p class=options>x axis: " + " ".join(
            f'<a href="{esc(link("/runs", id=selected, x=axis))}"' + (" class=on" if axis == x else "")
            + f">{axis}</a>" for axis in ("step", "time")) + "</p>")
        for fig in figures.run_curves(with_points, x):
            page.figure(fig)
        thinned = [c for c in chosen if c["curves"]["train_points"] > c["curves"]["max_points"]]
        if thinned:
            page.add("<p class=meta>Long runs are thinned to the lowest and highest point of each of "
                     f"{(chosen[0]['curves']['max_points'] - 2) // 2} buckets per curve.</p>")
    empty = [c["id"] for c in chosen if c not in with_points]
    if empty:
        page.add(message("no metrics yet: " + ", ".join(empty), "empty"))
    page.add(plan_checks(chosen_summaries(all_runs, selected)))
    if not chosen and all_runs:
        page.add(message("Pick runs above to compare them.", "empty"))
    if any(r.get("status") == "running" for r in chosen_summaries(all_runs, selected)):
        page.refresh_seconds = 30
    return page.render()


def plan_checks(summaries: list[dict[str, Any]]) -> str:
    """Runs with a plan against its predictions (run.json's `plan_check`): peak and step, measured and predicted,
    and what `agoq train` warned about."""
    rows, warnings = [], []
    for r in summaries:
        c = r.get("plan_check")
        if not c:
            continue

        def error(key: str) -> str:
            return f"{c[key]:+.1%}" if isinstance(c.get(key), (int, float)) else "-"

        over = c.get("measured_peak_bytes") is not None and c.get("budget_bytes") \
            and c["measured_peak_bytes"] > c["budget_bytes"]
        rows.append([esc(r["id"]), fmt_num(c.get("steps")), fmt_bytes(c.get("budget_bytes")),
                     fmt_bytes(c.get("predicted_peak_bytes")),
                     (f'<span class=bad>{fmt_bytes(c.get("measured_peak_bytes"))}</span>' if over
                      else fmt_bytes(c.get("measured_peak_bytes"))), error("peak_error"),
                     fmt_seconds(c.get("predicted_step_seconds")), fmt_seconds(c.get("measured_step_seconds")),
                     error("step_error")])
        warnings += [f"{r['id']}: {w}" for w in c.get("warnings") or []]
    if not rows:
        return ""
    return ("<h2>Against the plan</h2>"
            + table(["run", "steps", "budget", "predicted peak", "measured peak (any step)", "peak vs predicted",
                     "predicted step", "measured step (median)", "step vs predicted"], rows)
            + "".join(message(w, "warn") for w in warnings))


def chosen_summaries(all_runs: list[dict[str, Any]], selected: list[str]) -> list[dict[str, Any]]:
    """The overview entries of the selected runs."""
    chosen = set(selected)
    return [r for r in all_runs if r["id"] in chosen]


def error_page(title: str, text: str) -> str:
    """A page holding only a message (unknown id, broken file)."""
    page = Page(title)
    page.add(message(text, "error"))
    page.add("<p><a href='/'>back to the overview</a></p>")
    return page.render()

