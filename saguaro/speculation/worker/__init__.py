"""The draft worker's process: nothing here imports the engine's side (tests/test_layers.py)."""
