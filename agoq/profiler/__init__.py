"""agoq's profiler: what each layer of a model keeps for backward, and what quantizing it costs.

`make_profile(ProfileSettings(spec, ...), out_dir)` measures a model and writes a Profile folder
(docs/formats.md); `agoq.formats.profile.load_profile(out_dir)` reads it back; `predicted_error(table, policy, num_layers)`
predicts a mixed policy's gradient error from the profile's sensitivities. `compare_policies` runs
whole policies side by side (`agoq activations`).
"""

from agoq.profiler.activations import PolicyReport, compare_policies
from agoq.profiler.additivity import predicted_error
from agoq.profiler.profile import ProfileSettings, make_profile

__all__ = ["PolicyReport", "compare_policies", "ProfileSettings", "make_profile", "predicted_error"]
