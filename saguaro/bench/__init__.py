"""`saguaro bench`: AR, SD, SSD and transformers (plain and assisted) side by side, with
tables, plots and every raw measurement."""
from saguaro.bench.runner import BenchConfig, fan_out_sweep, quick, run

__all__ = ["BenchConfig", "fan_out_sweep", "quick", "run"]
