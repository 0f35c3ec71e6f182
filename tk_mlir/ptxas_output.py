"""What ptxas reports about a kernel, read from its log."""
from __future__ import annotations

import re


def ptxas_info(log: str) -> dict:
    """The numbers in ptxas's -v log: registers per thread and spill bytes
    (absent when the log does not say)."""
    info = {}
    m = re.search(r"Used (\d+) registers", log)
    if m:
        info["registers"] = int(m.group(1))
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if m:
        info["spill stores (bytes)"], info["spill loads (bytes)"] = int(m.group(1)), int(m.group(2))
    return info
