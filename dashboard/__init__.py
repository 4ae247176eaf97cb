"""agoq's web dashboard over profiles, plans and runs (planned)."""
