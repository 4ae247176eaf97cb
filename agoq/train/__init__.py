"""agoq's training: the settings (config), one strategy per parallel mode (parallel), the optimizer steps
(optimizer), building a run (preparation), the loop (trainer), data, checkpoints and pipeline stages.
`agoq train` (agoq.commands.train) and `python -m agoq.train` drive it."""
