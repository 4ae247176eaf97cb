"""What the routes share, kept on the app's state by create_app (dashboard.app): `dashboard`, the readers of
everything under the root (dashboard.service.Dashboard, with its catalog); `planner`, the live search of
POST /api/plan (dashboard.planner.Planner); `access`, the access settings (dashboard.access.Access). A route
names what it uses as a parameter typed DashboardState or PlannerState (FastAPI dependencies, answered from
`request.app.state`; they add nothing to the OpenAPI document)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from dashboard.planner import Planner
from dashboard.service import Dashboard


async def dashboard(request: Request) -> Dashboard:
    """The app's readers (async: FastAPI runs it in the event loop, not a worker thread)."""
    return request.app.state.dashboard


async def planner(request: Request) -> Planner:
    """The app's planner."""
    return request.app.state.planner


DashboardState = Annotated[Dashboard, Depends(dashboard)]
PlannerState = Annotated[Planner, Depends(planner)]
