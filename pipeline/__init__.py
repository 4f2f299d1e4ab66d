"""The drafter release pipeline: verifier -> generate -> extract -> train (eval, card elsewhere)."""
