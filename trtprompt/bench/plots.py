"""PNG plots of benchmark runs (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from trtprompt.bench.report import safe_name
from trtprompt.bench.runner import RunResult

DPI = 90


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plain_log(axis: Any) -> None:
    """Log scale with plain numbers (10, 20, 50 ...) instead of 2x10^2 labels."""
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(ScalarFormatter())
    axis.set_minor_formatter(NullFormatter())


def _cdf(ax: Any, values: Sequence[float], label: str) -> None:
    xs = sorted(v * 1e3 for v in values)
    if xs:
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=f"{label} (n={len(xs)})")


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def plot_cdfs(runs: Mapping[str, RunResult], title: str, path: Path) -> Path:
    """TTFT, inter-token latency and end-to-end latency CDFs, one line per run."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    metrics = (("TTFT", lambda r: [x.ttft_s for x in r.records if x.ok]),
               ("inter-token latency", lambda r: [g for x in r.records if x.ok for g in x.itl_s]),
               ("end-to-end latency", lambda r: [x.e2e_s for x in r.records if x.ok]))
    for ax, (name, get) in zip(axes, metrics):
        for run_name, result in runs.items():
            _cdf(ax, get(result), run_name)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if name != "inter-token latency" else "fraction of gaps")
        ax.set_xscale("log")
        _plain_log(ax.xaxis)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_ylim(0, 1.02)
    axes[0].legend(fontsize=8, loc="lower right")
    fig.suptitle(title)
    return _save(plt, fig, path)


def plot_ttft_vs_len(runs: Mapping[str, RunResult], title: str, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for (run_name, result), marker in zip(runs.items(), "o^sDvx*+"):
        ok = [r for r in result.records if r.ok]
        ax.scatter([r.num_input_tokens or r.prompt_len for r in ok], [r.ttft_s * 1e3 for r in ok],
                   label=run_name, marker=marker, s=18, alpha=0.7)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    _plain_log(ax.yaxis)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title)
    return _save(plt, fig, path)


def plot_vs_concurrency(summaries: Mapping[str, Mapping[str, Mapping[str, Any]]], title: str, path: Path) -> Path:
    """Output tokens/s and TTFT p50/p99 against concurrency, one line per run name."""
    plt = _pyplot()
    fig, (ax_tp, ax_ttft) = plt.subplots(1, 2, figsize=(11, 3.8))
    names = sorted({n for by_run in summaries.values() for n in by_run})
    levels = sorted({s["concurrency"] for by_run in summaries.values() for n, s in by_run.items()
                     if s["concurrency"] is not None and not n.startswith("transformers")})
    for color, name in enumerate(names):
        points = sorted(((s["concurrency"], s) for by_run in summaries.values() for n, s in by_run.items()
                         if n == name and s["concurrency"] is not None), key=lambda p: p[0])
        if not points or name.startswith("transformers"):
            continue  # baselines run at their own fixed concurrency
        xs = [c for c, _ in points]
        c = f"C{color}"
        ax_tp.plot(xs, [s["output_tok_s"] for _, s in points], marker="o", color=c, label=name)
        ax_ttft.plot(xs, [s["ttft_s"]["p50"] * 1e3 for _, s in points], marker="o", color=c, label=f"{name} p50")
        ax_ttft.plot(xs, [s["ttft_s"]["p99"] * 1e3 for _, s in points], marker="x", color=c, linestyle="--",
                     label=f"{name} p99")
    ax_tp.set_ylabel("output tokens/s")
    ax_tp.set_ylim(bottom=0)
    ax_ttft.set_ylabel("TTFT (ms)")
    for ax in (ax_tp, ax_ttft):
        ax.set_xlabel("concurrency")
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(x) for x in levels])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return _save(plt, fig, path)


def write_plots(runs: Mapping[str, Mapping[str, RunResult]],
                summaries: Mapping[str, Mapping[str, Mapping[str, Any]]], out: Path) -> list[Path]:
    """Per load level: latency CDFs and TTFT against prompt length; across levels: throughput."""
    files = []
    out.mkdir(parents=True, exist_ok=True)
    for label, by_run in runs.items():
        kind = next(iter(by_run.values())).workload["kind"]
        stem = safe_name(f"{kind}_{label}")
        files.append(plot_cdfs(by_run, f"{kind}, {label}", out / f"{stem}_cdf.png"))
        files.append(plot_ttft_vs_len(by_run, f"TTFT vs prompt length: {kind}, {label}",
                                      out / f"{stem}_ttft_vs_len.png"))
    if len(summaries) > 1:  # several load levels
        kind = next(iter(next(iter(runs.values())).values())).workload["kind"]
        files.append(plot_vs_concurrency(summaries, f"{kind}: throughput and TTFT vs concurrency",
                                         out / f"{safe_name(kind)}_vs_concurrency.png"))
    return files
