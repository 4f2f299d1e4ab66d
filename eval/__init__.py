"""Evaluation of drafters against their verifier in vLLM."""
