"""The drafter release pipeline: the stages verifier -> generate -> extract -> train (eval,
licenses, card and publish live in ``eval/``, ``release/`` and ``model_card/``), the tools that
plan, measure and serve (``tools/``), the plumbing that runs vLLM and speculators
(``serving/``, ``training/``), and the core every layer stands on (``core/``).
Imports point down that list, never from one stage to another."""
