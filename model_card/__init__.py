"""The drafter's model card: a build artifact rendered from the run's manifests and results."""
