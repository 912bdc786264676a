"""`p2psync bench`: p2psync and the broadcast path side by side on this machine.

`run_bench(BenchOptions(...))` returns the JSON-ready result; `format_report` prints it as
text; `save` keeps it as a JSON file. Heavy imports happen inside the functions.
"""

from .report import format_report
from .results import save
from .options import BenchOptions
from .runner import run_bench

__all__ = ["BenchOptions", "format_report", "run_bench", "save"]
