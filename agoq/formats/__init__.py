"""The files agoq writes and reads (docs/formats.md): one module per format, its only reader and writer.

`plan` (agoq.plan/1), `profile` (agoq.profile/1, its header's checks in `profile_header`), `run` (agoq.run/1 and
metrics.jsonl), `measured_steps`, `pareto` (the search's Pareto CSV); `schema` is the one schema check of every JSON
file, and `views` the read-only views for readers that only show files (the dashboard).
"""
