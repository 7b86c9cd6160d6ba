"""The engine's side of SSD: draft worker clients and the pool that supervises them."""
