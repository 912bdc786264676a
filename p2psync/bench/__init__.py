"""`p2psync bench`: p2psync and the broadcast path side by side on this machine.

`run_bench(BenchOptions(...))` returns the JSON-ready result; `format_report`
prints it as a table. Heavy imports happen inside the functions.
"""

from .report import format_report
from .runner import BenchOptions, run_bench

__all__ = ["BenchOptions", "format_report", "run_bench"]
