"""Speculation: what proposes the tokens a round verifies and what chooses how to speculate.

local/   proposers that run in the engine's process (draft model, EAGLE, prompt lookup, n-gram)
remote/  the engine's side of SSD: the client of each draft worker and the pool that supervises them
worker/  the draft worker's process alone: its loop, the speculator and the speculation cache
policy/  what chooses each round's speculation (fixed, or auto's cost model) and fan-out planning
protocol.py  the typed messages both sides of SSD exchange
"""
