"""The processes a plan must run in: one rule for every layout that needs a given world size.

A plan's predicted peak memory and step time hold for the layout it was searched for (its `launch`,
docs/formats.md "Plan"): a pipeline of S stages runs S processes, one per stage; agoq's sharded SDP4Bit step and
FSDP2 shard the optimizer state, gradients (and FSDP2's parameters) over the N ranks of the profile, so each
rank holds 1/N of them. Such a plan in another number of processes would train with exit 0 and figures that
do not apply, so it is refused with the command that launches it as searched. Replicated plans (none, ddp)
keep the whole state on every rank and run in any number of processes.
"""

from __future__ import annotations

from dataclasses import dataclass

SHARDED = ("sharded", "fsdp")  # both shard over the ranks (and both run sdp4bit gradients)
REPLICATED = ("none", "ddp")  # one process and DDP keep the same per-rank state


@dataclass(frozen=True)
class PlanLayout:
    """A layout that fixes the world size: its parallel mode and processes (None: several, number unrecorded)."""

    parallel: str
    processes: int | None

    def fits(self, parallel: str) -> bool:
        """Whether a run in parallel mode `parallel` runs this layout (sharded and fsdp count as one)."""
        return parallel == self.parallel or (parallel in SHARDED and self.parallel in SHARDED)


def plan_launch(plan) -> dict:
    """The plan's `launch` section (processes, parallel mode, command), {} when it has none (1.0 plans)."""
    launch = plan.to_dict().get("launch")
    return launch if isinstance(launch, dict) else {}


def plan_layout(plan) -> PlanLayout | None:
    """The layout `plan` needs a given number of processes for, or None when any number runs it (replicated).

    A pipeline of S > 1 stages needs S; a `launch` that is sharded or fsdp needs its `processes`; a plan without
    a `launch` (1.0) whose gradients are sdp4bit is agoq's sharded step over an unrecorded number of ranks."""
    launch = plan_launch(plan)
    if plan.pipeline.stages > 1:
        return PlanLayout("pipeline", plan.pipeline.stages)
    if launch.get("parallel") in SHARDED:
        processes = int(launch.get("processes") or 0)
        return PlanLayout(launch["parallel"], processes if processes > 1 else None)
    if not launch and plan.gradients.mode == "sdp4bit":
        return PlanLayout("sharded", None)
    return None


def plan_parallel_default(plan, world) -> str | None:
    """The parallel mode the plan's layout asks for when --parallel is not given, or None (the usual default:
    none for one process, ddp under torchrun). Only several processes take it: one process is refused by
    `check_plan_world` with the command that launches the plan."""
    layout = plan_layout(plan)
    return layout.parallel if layout is not None and world.size > 1 else None


def launch_command(plan, layout: PlanLayout, model: str, plan_path: str) -> str:
    """The command that runs `plan` as searched: its `launch.command` with MODEL and PLAN.json filled in."""
    processes = layout.processes or "N"
    command = plan_launch(plan).get("command") or (f"torchrun --nproc-per-node {processes} -m agoq.train MODEL "
                                                   f"--plan PLAN.json --parallel {layout.parallel}")
    return command.replace("MODEL", model).replace("PLAN.json", plan_path)


def check_plan_world(plan, world_size: int, parallel: str | None, model: str, plan_path: str) -> None:
    """Refuse to run `plan` in `world_size` processes, or in parallel mode `parallel` (None: not decided yet),
    when its layout needs another (`plan_layout`): the message gives the command that launches it."""
    layout = plan_layout(plan)
    if layout is None:
        return
    wrong_size = world_size != layout.processes if layout.processes else world_size < 2
    if not wrong_size and (parallel is None or layout.fits(parallel)):
        return
    what = (f"a {layout.processes}-stage pipeline" if layout.parallel == "pipeline" else
            f"{layout.parallel} over {layout.processes or 'several'} processes")
    now = f"{world_size} process{'es' if world_size > 1 else ''}" + ("" if wrong_size else f", --parallel {parallel}")
    raise ValueError(f"{plan_path}: the plan was searched for {what} (its predicted peak and step time hold for "
                     f"that layout only), this run has {now}: launch it as the plan says: "
                     f"{launch_command(plan, layout, model, plan_path)}; or search a plan for this layout")


__all__ = ["PlanLayout", "plan_launch", "plan_layout", "plan_parallel_default", "launch_command",
           "check_plan_world", "SHARDED", "REPLICATED"]
