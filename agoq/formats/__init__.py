"""The files agoq writes and reads (docs/formats.md): one module per format, its only reader and writer.

`plan` (agoq.plan/1), `profile` (agoq.profile/1), `run` (agoq.run/1); `json` holds what they share
(atomic writes, non-finite numbers as null).
"""
