"""Proposers that run in the engine's process."""
