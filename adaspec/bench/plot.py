"""The bench plot: tokens per second against concurrency for every arm, and per-position
acceptance of every speculative arm (matplotlib, an optional extra).

The plot is rendered in memory and written by the command, so a write that fails (a full
disk) is the command's one-line error about --plot, not an image library's traceback."""

import io
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display is needed or wanted

import matplotlib.pyplot as plt  # noqa: E402


def render_png(report: dict[str, Any]) -> bytes:
    """The report's plot as PNG bytes."""
    entries = report["arms"]
    levels = report["settings"]["concurrency"]
    names = list(dict.fromkeys(e["arm"] for e in entries))
    figure, (rates, positions) = plt.subplots(1, 2, figsize=(12, 4.5))
    for index, name in enumerate(names):
        mine = {e["concurrency"]: e for e in entries if e["arm"] == name}
        style = "-" if name.startswith("adaptive") else "--" if name == "none" else ":"
        color = f"C{index % 10}"  # one colour per arm in both panels
        rates.plot(levels, [mine[c]["tokens_per_second"] for c in levels], style, marker="o",
                   color=color, label=name,
                   linewidth=2.2 if name.startswith("adaptive") else 1.2)
        top = mine[levels[-1]]["position_acceptance"]
        if top:
            positions.plot(range(1, len(top) + 1), top, style, marker="o", color=color,
                           label=name)
    rates.set_xscale("log", base=2)
    rates.set_xticks(levels, [str(c) for c in levels])
    rates.set_xlabel("concurrency (requests in flight)")
    rates.set_ylabel("output tokens per second")
    rates.set_title("throughput")
    rates.legend(fontsize=8)
    positions.xaxis.get_major_locator().set_params(integer=True)  # positions are whole
    positions.set_xlabel("draft position k")
    positions.set_ylabel("accepted drafts 1..k, of request-rounds verifying k")
    positions.set_title(f"per-position acceptance at concurrency {levels[-1]}")
    positions.set_ylim(0, 1)
    if positions.get_lines():  # no speculative arm: no line, and no legend to warn about
        positions.legend(fontsize=8)
    figure.suptitle(f"adaspec bench ({report['machine']}; {sampling_title(report)})",
                    fontsize=9)
    figure.tight_layout()
    png = io.BytesIO()
    try:
        figure.savefig(png, format="png", dpi=110)
    finally:
        plt.close(figure)
    return png.getvalue()


def sampling_title(report: dict[str, Any]) -> str:
    """Which requests the figures cover: the tokens/s and acceptance mix the kinds."""
    temperatures = report["settings"]["sampling"]["temperatures"]
    if temperatures == [0.0]:
        return "greedy"
    shown = ", ".join(f"{t:g}" for t in temperatures)
    return f"temperature{'s' if len(temperatures) > 1 else ''} {shown}, all requests together"
