"""agoq's web dashboard: a read-only FastAPI app with Plotly pages over the profiles, searches, plans
and training runs found under one folder (`agoq dashboard --root DIR`; `dashboard.app.create_app`)."""
