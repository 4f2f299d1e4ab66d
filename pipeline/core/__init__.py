"""Core: the profile schema, the run folder and its typed stage contracts, the readers of
shared artifacts, atomic files, and the one-line errors a user sees. Imports no other layer."""
