"""Serving plumbing: vLLM as a guarded child process or a container, its command line and
flags, the chat client and /metrics. Imports only core."""
