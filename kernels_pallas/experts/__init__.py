"""The routed experts' products for decode and verify steps (README.md beside this file)."""
