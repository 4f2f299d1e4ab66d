"""Training plumbing: launching speculators' EAGLE-3 trainer and reading what it wrote."""
