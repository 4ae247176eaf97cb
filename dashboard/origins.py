"""Which results on the overview are predictions for a GPU and which come from a run on the CPU.

`agoq demo` puts two kinds of results under one root, and a newcomer must be able to tell them apart:
- GPU predictions: the profiles of real models measured on real GPUs that agoq ships (agoq.examples, copied by the
  demo to OUT/examples/), and whatever is planned from them (the budget slider on their pages): the plans' peaks and
  step times are predictions for that GPU;
- the CPU demo run: the tiny model profiled, searched and trained on this machine's CPU, a functional check that
  training with a plan works end to end. Its step times and memory are not what plans are for: the CPU has no
  allocator statistics (predicted peaks leave its workspace out, measured peaks are the whole process's memory) and
  an eager CPU step is set by the host.

A result's device is what its own file records: a profile's and a run's `hardware.device`, a plan's `source.device`
(the device its profile was measured on), a search's chosen plan's."""

from __future__ import annotations

from typing import Any

from agoq.formats.views import FormatError, read_profile_header
from dashboard.markup import esc, link


def shipped_profiles() -> set[tuple[str, str]]:
    """(fingerprint, date) of the example profiles agoq ships (agoq.examples); empty when none can be read."""
    try:
        from agoq.examples import profiles
    except ImportError:
        return set()
    out = set()
    for folder in profiles().values():
        try:
            meta = read_profile_header(folder / "profile.json")
        except FormatError:
            continue
        out.add((str((meta.get("model") or {}).get("fingerprint")), str(meta.get("date"))))
    return out


def on_cpu(device: Any) -> bool | None:
    """True for "cpu", False for a GPU ("cuda", or a GPU's name), None when not recorded."""
    if not device:
        return None
    return str(device).lower() == "cpu"


def classify(data: dict[str, Any]) -> dict[str, dict[str, list[str]]]:
    """{"gpu": {kind: ids}, "cpu": {kind: ids}} of the overview's entries (kind: profiles, searches, plans, runs;
    entries whose device is not recorded, or that cannot be read, are in neither)."""
    out: dict[str, dict[str, list[str]]] = {"gpu": {}, "cpu": {}}

    def put(cpu: bool | None, kind: str, item_id: str) -> None:
        if cpu is not None:
            out["cpu" if cpu else "gpu"].setdefault(kind, []).append(item_id)

    for p in data.get("profiles") or []:
        put(on_cpu(p.get("hardware_device") or p.get("device")) if "error" not in p else None, "profiles", p["id"])
    chosen = {}
    for p in data.get("plans") or []:
        if "error" in p:
            continue
        if p.get("search") is None or p.get("chosen"):  # a front's plans are its search's, as on the overview
            put(on_cpu(p.get("profiled_on")), "plans", p["id"])
        if p.get("chosen"):
            chosen[p.get("search")] = on_cpu(p.get("profiled_on"))
    for s in data.get("searches") or []:
        put(chosen.get(s["id"]), "searches", s["id"])
    for r in data.get("runs") or []:
        put(on_cpu(r.get("device")) if "error" not in r else None, "runs", r["id"])
    return out


def _listed(ids: list[str], page: str) -> str:
    shown = ", ".join(f'<a href="{esc(link(page, id=i))}">{esc(i)}</a>' for i in ids[:8])
    return shown + (f" and {len(ids) - 8} more" if len(ids) > 8 else "")


PAGES = {"profiles": "/profile", "searches": "/search", "plans": "/plan", "runs": "/runs"}


def overview_note(data: dict[str, Any]) -> str:
    """HTML saying which results are GPU predictions (and which of those profiles agoq ships) and which the CPU
    run's, and how to read each; "" when the root holds neither."""
    groups = classify(data)
    shipped = shipped_profiles()
    parts = []
    gpu = groups["gpu"]
    if gpu:
        ships = [p["id"] for p in data.get("profiles") or [] if p["id"] in gpu.get("profiles", [])
                 and (str(p.get("fingerprint")), str(p.get("date"))) in shipped]
        others = {kind: [i for i in ids if i not in ships] for kind, ids in gpu.items()}
        said = []
        if ships:
            said.append(f"the profiles {_listed(ships, '/profile')} are measurements of real models on real GPUs "
                        "that agoq ships (<code>agoq demo</code> copies them to <code>examples/</code>): open one "
                        "and move its budget slider to plan for that GPU")
        said += [f"{kind} {_listed(ids, PAGES[kind])}" for kind, ids in others.items() if ids]
        parts.append(f"<div class='msg info' id='origin-gpu'><b>GPU predictions</b>: {'; '.join(said)}. Their peaks "
                     "and step times are predictions for the GPU each profile was measured on.</div>")
    cpu = groups["cpu"]
    if cpu:
        said = "; ".join(f"{kind} {_listed(ids, PAGES[kind])}" for kind, ids in cpu.items())
        parts.append(f"<div class='msg info' id='origin-cpu'><b>CPU run</b>: {said}. Made on this machine's CPU "
                     "(as <code>agoq demo</code> does with a tiny model): a functional check that profiling, "
                     "searching and training with a plan work end to end. CPU step times and memory are not what "
                     "plans are for (no allocator statistics: predicted peaks leave the workspace out and measured "
                     "peaks are the whole process's memory); read them as \"it runs\", not as figures to budget "
                     "by.</div>")
    return "".join(parts)

