"""agoq's training: the settings (config), where a plan and the flags meet (plan_settings), device and dtype
(device), building a run (preparation) and applying its plan in one ordered step (apply), one strategy per
parallel mode (parallel), the optimizer steps (optimizer), the loop (trainer) and measuring its steps (measure),
data, checkpoints and pipeline stages. `agoq train` (agoq.commands.train) and `python -m agoq.train` drive it."""
