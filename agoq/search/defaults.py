"""The search's defaults, in one place (`agoq search`, `agoq profile --budget`, the dashboard's plan service):

  objective  "time": the most tokens/s that fits the budget
  error cap  "recipe": no more predicted gradient error than the published agoq-paper recipe on the profile
  time cap   None
"""

DEFAULT_OBJECTIVE = "time"
DEFAULT_ERROR_CAP = "recipe"
DEFAULT_TIME_CAP = None

__all__ = ["DEFAULT_OBJECTIVE", "DEFAULT_ERROR_CAP", "DEFAULT_TIME_CAP"]
