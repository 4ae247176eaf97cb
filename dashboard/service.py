"""What the dashboard answers, as plain JSON-ready dicts: the API returns them as they are and the
pages draw them. Unknown ids raise KeyError, unreadable files FormatError; a broken part of an
artifact (say its parquet table) is reported in that part as {"error": "..."} while the rest is shown."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from agoq.formats.views import FormatError
from dashboard import cluster, figures, plans, profiles, runs, searches, studies
from dashboard.discovery import Artifact, Catalog

MAX_POINTS_LIMIT = 20000


def part(fn: Callable[[], Any]) -> Any:
    """fn() or, when it fails on a broken file or a bad choice, {"error": message}."""
    try:
        return fn()
    except (FormatError, KeyError) as e:
        return {"error": e.args[0] if e.args else str(e)}


class Dashboard:
    """The data behind every endpoint, over the folders found under one root."""

    def __init__(self, root: str | os.PathLike, ttl: float = 2.0):
        self.catalog = Catalog(root, ttl=ttl)
        self.metrics = runs.MetricsStore()

    # --- overview -------------------------------------------------------------------------------
    def overview(self, refresh: bool = False) -> dict[str, Any]:
        """Everything found under the root with its key figures (or the error reading it)."""
        index = self.catalog.index(refresh=refresh)
        fold = self.catalog.folder
        readers = {"profiles": lambda a: profiles.summary(fold(a)),
                   "searches": self._search_summary,
                   "plans": lambda a: plans.summary(plans.read_plan(a.path)),
                   "runs": lambda a: runs.summary(fold(a), self.metrics)}
        out: dict[str, Any] = {"root": str(self.catalog.root), "scanned_at": index.scanned_at,
                               "problems": list(index.problems)}
        for kind, reader in readers.items():
            items = []
            for artifact_id, artifact in sorted(index.items[kind].items()):
                entry = {"id": artifact_id}
                try:
                    entry.update(reader(artifact))
                except FormatError as e:
                    entry["error"] = str(e)
                items.append(entry)
            out[kind] = items
        searches = {s["id"]: s for s in out["searches"]}
        for plan in out["plans"]:
            owner = next((sid for sid in sorted(searches, key=len, reverse=True)
                          if sid == "." or plan["id"].startswith(sid + "/")), None)
            plan["search"] = owner
            chosen = searches[owner].get("chosen_plan") if owner is not None else None
            plan["chosen"] = owner is not None and chosen is not None and \
                plan["id"] == (chosen if owner == "." else f"{owner}/{chosen}")
        return out

    def _search_summary(self, artifact: Artifact) -> dict[str, Any]:
        folder = self.catalog.folder(artifact)
        pareto = part(lambda: searches.read_pareto(folder))
        rows = pareto.get("rows", [])
        study = part(lambda: searches.study_file(folder))
        problems = [p["error"] for p in (pareto, study) if isinstance(p, dict) and "error" in p]
        peaks = [r["predicted_peak_bytes"] for r in rows if r.get("predicted_peak_bytes") is not None]
        chosen = searches.chosen_plan_name(self._plans_in(artifact))
        # the search's budget is its chosen plan's (pareto.csv's rows hold the front's own, smaller budgets)
        chosen_plan = part(lambda: plans.read_plan(artifact.path / chosen)) if chosen else {}
        budget = chosen_plan.get("budget_bytes") if isinstance(chosen_plan, dict) else None
        return {"pareto_plans": len(rows), "validated": self._validated(artifact, chosen, rows),
                "lowest_peak_bytes": min(peaks) if peaks else None,
                "budget_bytes": budget,
                "chosen_plan": chosen,
                "study": study.name if isinstance(study, Path) else None, "problems": problems}

    def _validated(self, search: Artifact, chosen: str | None, rows: list[dict[str, Any]]) -> int:
        """How many distinct plans the search ran for real (`agoq search --validate K`): its chosen plan and the
        front's plans (the Pareto rows' files) that record measured figures, a plan saved twice (chosen and on the
        front) counted once, and Pareto rows with measured figures but no readable plan file one each. The chosen
        plan is not a row of the front, so the rows alone miss it."""
        plan_ids = self.catalog.index().items["plans"]
        prefix = "" if search.id == "." else search.id + "/"
        names = ([chosen] if chosen else []) + [r["plan"] for r in rows if isinstance(r.get("plan"), str) and r["plan"]]
        seen: set[str] = set()
        unnamed = 0
        for name in dict.fromkeys(names):
            found = plan_ids.get(prefix + name)
            try:
                plan = plans.read_plan(found.path) if found is not None else None
            except FormatError:
                plan = None
            if plan is not None and plans.was_measured(plan):
                seen.add(plans.signature(plan))
        for r in rows:
            name = r.get("plan")
            if r.get("validated") and not (isinstance(name, str) and name and prefix + name in plan_ids):
                unnamed += 1
        return len(seen) + unnamed

    def planner_start(self, profile_id: str) -> dict[str, Any] | None:
        """The settings the profile page's budget slider starts from: those of the plan the pages show for this
        profile, so that the slider's first plan is laid out as that one (see plans.request_settings). The plan
        is one made from this profile (same model fingerprint; its `source.profile` naming this folder first):
        one a run trained with first, then a search's chosen plan (plan.json), then the newest. None: no plan
        was made from it."""
        a = self.catalog.get("profiles", profile_id)
        try:
            meta = profiles.header(self.catalog.folder(a))
        except FormatError:
            return None
        fingerprint = (meta.get("model") or {}).get("fingerprint")
        trained = set()
        for r in self.catalog.index().items["runs"].values():
            try:
                used = runs.read_meta(self.catalog.folder(r)).get("plan")
            except FormatError:
                continue
            if isinstance(used, dict):
                trained.add(plans.signature(used))
        ranked = []
        for plan_id, p in self.catalog.index().items["plans"].items():
            try:
                plan = plans.read_plan(p.path)
            except FormatError:
                continue
            if (plan.get("model") or {}).get("fingerprint") != fingerprint:
                continue
            source = str((plan.get("source") or {}).get("profile") or "")
            mine = bool(source) and (Path(source) == a.path or Path(source).name == a.path.name)
            ranked.append(((plans.signature(plan) in trained, mine, p.path.name == "plan.json",
                            str((plan.get("source") or {}).get("date") or ""), plan_id), plan_id, plan))
        if not ranked:
            return None
        _, plan_id, plan = max(ranked, key=lambda r: r[0])
        return {"plan": plan_id, **plans.request_settings(plan)}

    # --- one artifact ---------------------------------------------------------------------------
    def profile(self, artifact_id: str, option: str | None = None) -> dict[str, Any]:
        """A profile's key figures, heat maps at `option`, error curves and collective times."""
        a = self.catalog.get("profiles", artifact_id)
        folder = self.catalog.folder(a)
        summary = profiles.summary(folder)
        steps = None  # a profile of several ranks: its layout steps priced; of one: its one-process FSDP2 steps
        if int((summary.get("settings") or {}).get("world_size") or 1) > 1 or profiles.header(folder).get(
                "layout_steps"):
            steps = part(lambda: {**cluster.layout_steps(folder.path, profiles.header(folder)), "profile": a.id})
        return {"id": a.id, "summary": summary, "layout_steps": steps,
                "maps": part(lambda: profiles.layer_kind_maps(folder, option)),
                "curves": part(lambda: profiles.error_curves(folder)),
                "times": part(lambda: profiles.kind_times(folder)),
                "collectives": part(lambda: profiles.collectives(folder))}

    def plan(self, artifact_id: str) -> dict[str, Any]:
        """A plan's key figures, bit-width map, memory breakdown, and the runs that trained with it."""
        a = self.catalog.get("plans", artifact_id)
        plan = plans.read_plan(a.path)
        used_by = self._runs_with(plan)
        found = self._profile_artifact_for(plan)
        profile = found[1] if found else None
        summary = plans.summary(plan)
        steps = ((profile or {}).get("memory") or {}).get("steps") or []
        summary["bf16_predicted_peak_bytes"] = next(
            (s.get("predicted_peak_bytes") for s in steps if s.get("policy") == "bf16"), None)
        return {"id": a.id, "summary": summary, "bits": part(lambda: plans.bit_map(plan)),
                "memory": part(lambda: plans.memory_breakdown(plan, used_by)),
                "cluster": self._cluster(plan, found), "runs": sorted(used_by)}

    def _cluster(self, plan: dict[str, Any], found: tuple | None) -> dict[str, Any] | None:
        """The plan's layout as dimensions and its profile's layout steps priced (dashboard.cluster), for a plan or
        profile of several ranks; None otherwise."""
        shown = cluster.layout(plan)
        header = found[1] if found else None
        if not cluster.is_cluster(shown, header):
            return None
        steps: Any = {"empty": "no profile of this model under the root: its layout steps are not shown"}
        if found:
            folder = self.catalog.folder(found[0])
            steps = part(lambda: cluster.layout_steps(folder.path, header, shown))
            steps["profile"] = found[0].id
        return {"layout": shown, "layout_steps": steps}

    def plan_view(self, plan: dict[str, Any]) -> dict[str, Any]:
        """What the plan page shows of a plan not saved anywhere (one the planner just solved): key figures,
        bit-width map and memory breakdown as `plan` gives them, and their Plotly figures."""
        profile = self._profile_for(plan)
        summary = plans.summary(plan)
        steps = ((profile or {}).get("memory") or {}).get("steps") or []
        summary["bf16_predicted_peak_bytes"] = next(
            (s.get("predicted_peak_bytes") for s in steps if s.get("policy") == "bf16"), None)
        bits = plans.bit_map(plan)
        memory = plans.memory_breakdown(plan)
        return {"summary": summary, "bits": bits, "memory": memory,
                "figures": {"bits": figures.plan_bits(bits), "memory": figures.memory_breakdown(memory)}}

    def search(self, artifact_id: str) -> dict[str, Any]:
        """A search's Pareto front, its chosen plan (as `plan` gives it) and its Optuna studies."""
        a = self.catalog.get("searches", artifact_id)
        folder = self.catalog.folder(a)
        pareto = part(lambda: searches.read_pareto(folder))
        name = searches.chosen_plan_name(self._plans_in(a))
        chosen: Any = {"empty": "no plan file in this search folder"}
        references: list[dict[str, Any]] = []
        if name:
            plan_id = name if a.id == "." else f"{a.id}/{name}"
            chosen = part(lambda: self.plan(plan_id))
            references = self._references(a.path / name)
        study = part(lambda: searches.study_file(folder))
        study_part: Any = {"empty": "no Optuna study (study.db or study.journal) in this search folder: "
                                    "the search ran the MILP only (agoq search --method both to add one)"}
        if isinstance(study, dict):
            study_part = study
        elif study is not None:
            study_part = part(lambda: {"file": study.name, "studies": studies.read_studies(study)})
        if "rows" in pareto:
            plan_ids = self.catalog.index().items["plans"]
            prefix = "" if a.id == "." else a.id + "/"
            for row in pareto["rows"]:
                name = row.get("plan")
                row["plan_id"] = prefix + name if isinstance(name, str) and prefix + name in plan_ids else None
        return {"id": a.id, "pareto": pareto, "chosen_plan": chosen, "study": study_part, "references": references}

    def _references(self, plan_path: Path) -> list[dict[str, Any]]:
        """The steps the plan's profile measured (plain bf16, the published agoq-paper recipe, ...): their
        predicted peak and measured step time, the points a plan is judged against; [] when unknown."""
        try:
            meta = self._profile_for(plans.read_plan(plan_path))
        except FormatError:
            return []
        steps = ((meta or {}).get("memory") or {}).get("steps") or []
        return [{"name": str(st.get("policy")), "peak_bytes": st.get("predicted_peak_bytes"),
                 "step_seconds": st.get("step_seconds")} for st in steps
                if st.get("predicted_peak_bytes") is not None and st.get("step_seconds") is not None]

    def run(self, artifact_id: str) -> dict[str, Any]:
        """A run's key figures and settings."""
        a = self.catalog.get("runs", artifact_id)
        folder = self.catalog.folder(a)
        meta = runs.read_meta(folder)
        return {"id": a.id, "summary": runs.summary(folder, self.metrics),
                "settings": meta.get("settings"), "world": meta.get("world"), "hardware": meta.get("hardware")}

    def curves(self, artifact_id: str, max_points: int = 2000) -> dict[str, Any]:
        """A run's curves thinned to at most `max_points` points each."""
        if not 4 <= max_points <= MAX_POINTS_LIMIT:
            raise ValueError(f"points must be between 4 and {MAX_POINTS_LIMIT}, got {max_points}")
        a = self.catalog.get("runs", artifact_id)
        folder = self.catalog.folder(a)
        runs.read_meta(folder)
        return {"id": a.id, "curves": runs.curves(folder, self.metrics, max_points)}

    # --- links between artifacts ----------------------------------------------------------------
    def _plans_in(self, search: Artifact) -> list[str]:
        """Names of the plan files lying directly in a search folder."""
        return sorted(p.path.name for p in self.catalog.index().items["plans"].values()
                      if p.path.parent == search.path)

    def _profile_for(self, plan: dict[str, Any]) -> dict[str, Any] | None:
        """profile.json of the model the plan is for (same fingerprint), preferring the folder the
        plan names as its source."""
        found = self._profile_artifact_for(plan)
        return found[1] if found else None

    def _profile_artifact_for(self, plan: dict[str, Any]) -> tuple[Artifact, dict[str, Any]] | None:
        """(the profile's artifact, its profile.json) as `_profile_for` picks it."""
        fingerprint = (plan.get("model") or {}).get("fingerprint")
        source = Path(str((plan.get("source") or {}).get("profile") or "")).name
        found = []
        for a in self.catalog.index().items["profiles"].values():
            try:
                meta = profiles.header(self.catalog.folder(a))
            except FormatError:
                continue
            if (meta.get("model") or {}).get("fingerprint") == fingerprint:
                found.append((a.path.name != source, a.id, a, meta))
        return min(found, key=lambda f: f[:2])[2:] if found else None

    def _runs_with(self, plan: dict[str, Any]) -> dict[str, list | None]:
        """Runs that trained with this plan (same model, budget and per-layer choices): run id ->
        highest peak bytes per rank, or None for a run on the CPU (whose recorded peak is the
        process's memory, not comparable with a GPU prediction)."""
        out = {}
        for a in self.catalog.index().items["runs"].values():
            folder = self.catalog.folder(a)
            try:
                meta = runs.read_meta(folder)
                metrics_file = folder.file("metrics.jsonl")
            except FormatError:
                continue
            used = meta.get("plan") if isinstance(meta.get("plan"), dict) else None
            if not used or used.get("layers") != plan.get("layers") or used.get("budget_bytes") != plan.get("budget_bytes") \
                    or (used.get("model") or {}).get("fingerprint") != (plan.get("model") or {}).get("fingerprint"):
                continue
            if (meta.get("hardware") or {}).get("device") == "cpu":
                out[a.id] = None
                continue
            m = self.metrics.read(metrics_file)
            ranks = max((len(r) for r in m.peak), default=0)
            out[a.id] = [max((row[i] for row in m.peak if i < len(row) and row[i] is not None), default=None)
                         for i in range(ranks)]
        return out
