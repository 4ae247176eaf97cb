"""agoq's training loop and launcher (planned)."""
