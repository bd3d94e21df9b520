"""The formatting helpers every renderer of dev/render_docs.py shares (dev/doc_renderers.py and its
doc_renderers_*.py modules import them from here, so that any of them can be imported first).
"""
from __future__ import annotations


def num(value: float, places: int = 2) -> str:
    """`num(1.0435, 3)` -> '1.044'; `num(195584, 0)` -> '195,584' (thousands separated when no decimals)."""
    return f"{value:,.0f}" if places == 0 else f"{value:.{places}f}"


def pct(value: float, places: int = 1, sign: bool = False) -> str:
    """A fraction as a percentage: `pct(0.179)` -> '17.9%'; `pct(-0.0246, 2, sign=True)` -> '−2.46%'."""
    text = f"{value * 100:+.{places}f}%" if sign else f"{value * 100:.{places}f}%"
    return text.replace("-", "−")


def mib(n_bytes: float, places: int = 2) -> str:
    """Bytes in MiB: `mib(33660928)` -> '32.10'."""
    return f"{n_bytes / 2**20:.{places}f}"


def table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table: `table(["a", "b"], [["1", "2"]])` -> '| a | b |\\n|---|---|\\n| 1 | 2 |'."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def yes_no(flag: bool) -> str:
    return "yes" if flag else "no"
