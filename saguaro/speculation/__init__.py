"""Speculation: drafters, synchronous SD, the two sides of SSD (target and draft worker), the
speculation cache and the planning of fan-out and backup."""
