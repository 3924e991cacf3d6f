"""The bench plot: tokens per second against concurrency for every arm, and per-position
acceptance of every speculative arm (matplotlib, an optional extra)."""

from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display is needed or wanted

import matplotlib.pyplot as plt  # noqa: E402


def save_plot(report: dict[str, Any], path: str) -> None:
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
    positions.legend(fontsize=8)
    figure.suptitle(f"adaspec bench ({report['machine']})", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
