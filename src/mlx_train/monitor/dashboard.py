"""The monitor's screen: a rich renderable built from a ``RunSnapshot``.

Example::

    from rich.console import Console
    from mlx_train.monitor import RunReader, render

    Console().print(render(RunReader("runs/a").read(), performance=True, width=100))
"""

from __future__ import annotations

import os
import time
from typing import Any

from rich import box
from rich.console import Group, JustifyMethod, RenderableType
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from mlx_train.monitor.chart import Series, format_number, line_chart
from mlx_train.monitor.run import TIMING_PARTS, RunSnapshot

STATE_STYLES = {"running": "bold green", "finished": "bold blue", "stale": "bold white on red",
                "stopped": "bold white on red", "failed": "bold white on red", "interrupted": "bold yellow",
                "unknown": "dim"}
PART_NAMES = {"time_data": "waiting for data", "time_compute": "compute", "time_comm": "communication",
              "time_checkpoint": "checkpointing", "time_other": "other (callbacks, logging)"}


def format_duration(seconds: float | None) -> str:
    """``3725 -> "1:02:05"``; ``None -> "?"``."""
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def format_age(seconds: float) -> str:
    """``4.2 -> "4s ago"``, ``130 -> "2m10s ago"``, ``7300 -> "2h01m ago"``."""
    s = int(seconds)
    if s < 60:
        return f"{s}s ago"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s ago"
    return f"{s // 3600}h{s % 3600 // 60:02d}m ago"


def format_size(count: float) -> str:
    """Bytes in decimal units: ``229388 -> "229.4 KB"``, ``12 -> "12 B"``."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count:.0f} B"


def format_seconds(seconds: float) -> str:
    """A short duration for step times: ``0.00146 -> "1.46 ms"``, ``2.5 -> "2.50 s"``."""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} µs"


def _metric(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if 1e-3 <= abs(value) < 1e5 or value == 0 else f"{value:.3e}"
    return str(value)


def _header(snap: RunSnapshot) -> RenderableType:
    state = snap.state
    title = Text.assemble(("mlx-train monitor  ", "bold"), (snap.run_dir, "bold cyan"), "  ",
                          (f" {state.upper()} ", STATE_STYLES.get(state, "")))
    cfg = snap.config
    lines = [title]
    if cfg:
        accumulation = cfg.get("gradient_accumulation", 1)
        batch = f"batch {cfg.get('batch_size')}" + (f" x {accumulation} accumulation" if accumulation != 1 else "")
        lines.append(Text(f"{cfg.get('model')} on {cfg.get('dataset')} · {batch} · {cfg.get('optimizer')} "
                          f"lr {format_number(float(cfg.get('learning_rate', 0)))} · {cfg.get('precision')} · "
                          f"seed {cfg.get('seed')}", style="dim"))
    for rank in snap.ranks:
        beat = rank.heartbeat
        if rank.status == "stale":
            lines.append(Text(f"!! rank {rank.rank}: heartbeat is stale, last beat {format_age(rank.age)} at step "
                              f"{beat.get('step')} (limit {rank.stale_limit:.0f}s): hung, or stopped without "
                              "saying so", style="bold red"))
        elif rank.status == "gone":
            lines.append(Text(f"!! rank {rank.rank}: process {beat.get('pid')} is gone (killed?); last heartbeat "
                              f"{format_age(rank.age)} at step {beat.get('step')}", style="bold red"))
        elif rank.status in ("failed", "interrupted") and beat.get("error"):
            lines.append(Text(f"!! rank {rank.rank} {rank.status}: {beat['error']}", style="bold red"))
    return Group(*lines)


def _progress(snap: RunSnapshot, width: int) -> RenderableType:
    total, step = snap.total_steps, snap.step
    fraction = min(step / total, 1.0) if total else 0.0
    epochs = snap.epochs_total
    rate = snap.steps_per_second
    parts = [f"step {step}" + (f"/{total} ({fraction:.0%})" if total else ""),
             f"epoch {snap.epoch + 1}" + (f"/{epochs}" if epochs else ""),
             f"elapsed {format_duration(snap.elapsed)}", f"ETA {format_duration(snap.eta)}"]
    if rate:
        parts.append(f"{rate:,.1f} steps/s")
    info = Text(" · ".join(parts))
    bar_width = max(width - len(info.plain) - 4, 10)
    grid = Table.grid(padding=(0, 1))
    grid.add_row(ProgressBar(total=float(total or 1), completed=float(step if total else 0), width=bar_width), info)
    return grid


def _loss_chart(snap: RunSnapshot, width: int, height: int) -> RenderableType:
    series = [Series("train loss", *snap.series("loss"), "cyan")]
    vx, vy = snap.series("val_loss")
    if vy:
        series.append(Series("val loss", vx, vy, "magenta"))
    values = [y for s in series for y in s.ys]
    log_y = bool(values) and min(values) > 0 and max(values) / min(values) > 20  # early steps would flatten the rest
    title = "loss (log scale)" if log_y else "loss"
    return Panel(line_chart(series, width - 4, height - 2, log_y=log_y), title=title, box=box.ROUNDED,
                 height=height, width=width)


def _small_chart(title: str, series: list[Series], width: int, height: int) -> RenderableType:
    return Panel(line_chart(series, width - 4, height - 2), title=title, box=box.ROUNDED, height=height, width=width)


def _latest(snap: RunSnapshot, width: int, height: int) -> RenderableType:
    last = snap.latest
    table = Table.grid(padding=(0, 2))
    table.add_column(style="dim", no_wrap=True, overflow="ellipsis")
    table.add_column(justify="right", no_wrap=True)
    if "loss" in last:
        table.add_row("train loss", f"{last['loss']:.4f}")
    val = snap.val[-1] if snap.val else {}
    for key, value in val.items():
        if key.startswith("val_") and key != "val_time" and isinstance(value, (int, float)):
            table.add_row(key.replace("_", " "), _metric(value))
    best = snap.best("val_loss")
    if best:
        table.add_row("best val loss", f"{best[0]:.4f} @ {best[1]}")
    if snap.epochs:
        table.add_row("train loss/epoch", _metric(snap.epochs[-1].get("train_loss", float("nan"))))
    if "learning_rate" in last:
        table.add_row("learning rate", f"{last['learning_rate']:.3e}")
    if "grad_norm" in last:
        table.add_row("grad norm", f"{last['grad_norm']:.4f}")
    if "sparsity" in last:  # reported by the Pruning callback
        table.add_row("sparsity", f"{last['sparsity']:.1%}")
    if "reward_accuracy" in last:  # reported by a preference loss (DPO, ORPO)
        table.add_row("reward accuracy", f"{last['reward_accuracy']:.3f}")
        table.add_row("reward margin", _metric(last.get("reward_margin")))
    if "samples_per_second" in last:
        table.add_row("samples/s", f"{last['samples_per_second']:,.0f}")
    if "tokens_per_second" in last:
        table.add_row("tokens/s", f"{last['tokens_per_second']:,.0f}")
    if "peak_memory_gb" in last:
        table.add_row("peak memory", f"{last['peak_memory_gb']:.3f} GB")
    if "trained_samples" in last:
        table.add_row("samples seen", f"{last['trained_samples']:,}")
    return Panel(table, title=f"latest (step {last.get('step', '-')})", box=box.ROUNDED, width=width, height=height)


def _ranks(snap: RunSnapshot) -> RenderableType:
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), expand=False)
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("rank", "right"), ("host", "left"), ("pid", "right"), ("state", "left"), ("step", "right"),
        ("steps/s", "right"), ("samples/s", "right"), ("active mem", "right"), ("peak mem", "right"),
        ("heartbeat", "right"))
    for name, justify in columns:
        table.add_column(name, justify=justify)
    for rank in snap.ranks:
        beat = rank.heartbeat
        style = "bold red" if rank.flagged or rank.status == "failed" else ""
        status = rank.status.upper() if rank.flagged else rank.status
        # The main rank's rate is the run's (the header's): one number per run, from one definition.
        sps = snap.steps_per_second if rank is snap.ranks[0] else beat.get("steps_per_second")
        samples = beat.get("samples_per_second")
        table.add_row(
            str(rank.rank), str(beat.get("host", "?")), str(beat.get("pid", "?")), Text(status, style=style),
            str(beat.get("step", "?")), f"{sps:,.1f}" if sps else "-", f"{samples:,.0f}" if samples else "-",
            f"{beat.get('active_memory_gb', 0):.3f} GB", f"{beat.get('peak_memory_gb', 0):.3f} GB",
            Text(format_age(rank.age), style=style),
        )
    if not snap.ranks:
        return Text("no heartbeat files (heartbeat-<rank>.json) in this run directory yet", style="dim")
    return table


def _checkpoints(snap: RunSnapshot) -> RenderableType:
    if not snap.checkpoints:
        return Text("latest checkpoint: none yet", style="dim")
    last = snap.checkpoints[-1]
    shown = os.path.relpath(last.path, snap.run_dir) if last.path.startswith(snap.run_dir) else last.path
    metrics = "  ".join(f"{k} {v:.4f}" for k, v in last.metrics.items()
                        if k.startswith("val_") and k != "val_time" and isinstance(v, (int, float)))
    return Text.assemble(("latest checkpoint: ", "dim"), (shown, "bold"),
                         f"  step {last.step}, saved {format_age(max(snap.now - last.saved_at, 0))}",
                         (f"  {metrics}" if metrics else ""), (f"  ({len(snap.checkpoints)} kept)", "dim"))


def _bar(fraction: float, width: int) -> str:
    cells = fraction * width
    full = int(cells)
    partial = " ▏▎▍▌▋▊▉"[int((cells - full) * 8)] if full < width else ""
    return ("█" * full + partial).rstrip()


def _performance(snap: RunSnapshot, width: int) -> RenderableType:
    timing = snap.timing()
    if not timing:
        return Panel(Text("no step timings yet (they come with the first report)", style="dim"),
                     title="where step time goes", box=box.ROUNDED, width=width)
    step = timing["step_time"]
    table = Table.grid(padding=(0, 2))
    for justify in ("left", "right", "right", "left"):
        table.add_column(justify=justify)
    table.add_row(Text("step time", style="bold"), Text(format_seconds(step), style="bold"),
                  f"{1 / step:,.1f} steps/s of training" if step > 0 else "",
                  Text("(validation and checkpoints left out)", style="dim"))
    bar_width = max(width - 60, 10)
    for key in TIMING_PARTS + ("time_other",):
        share = timing[key] / step if step > 0 else 0.0
        table.add_row(PART_NAMES[key], format_seconds(timing[key]), f"{share:6.1%}",
                      Text(_bar(share, bar_width), style="cyan"))
    rows: list[RenderableType] = [table]
    if "comm_bytes" in timing:
        rows.append(Text(f"communication: {timing['comm_collectives']:,.0f} collectives a step, "
                         f"{format_size(timing['comm_bytes'])} from each rank (timed by replaying them)",
                         style="dim"))
    per_rank = [r for r in snap.ranks if r.heartbeat.get("timing")]
    if len(per_rank) > 1:
        ranks = Table(box=box.SIMPLE_HEAD, padding=(0, 1))
        for name in ("rank", "step time", "data", "compute", "comm", "checkpoint"):
            ranks.add_column(name, justify="right")
        for rank in per_rank:
            t = rank.heartbeat["timing"]
            times = (format_seconds(float(t.get(k, 0.0))) for k in ("step_time",) + TIMING_PARTS)
            ranks.add_row(str(rank.rank), *times)
        rows.append(ranks)
    n = min(len([r for r in snap.train if "step_time" in r]), 5)
    return Panel(Group(*rows), title=f"where step time goes (mean of the last {n} reports)", box=box.ROUNDED,
                 width=width)


def render(snap: RunSnapshot, performance: bool = False, width: int = 100, height: int | None = None,
           footer: str = "") -> RenderableType:
    """The whole dashboard for a terminal ``width`` columns wide (and ``height`` rows, when live)."""
    width = max(width, 60)
    panel = 9 + (len(snap.ranks) + 3 if len(snap.ranks) > 1 else 0) + ("comm_bytes" in snap.timing())
    fixed = 3 + len(snap.ranks) + 4 + 2 + len(snap.log_lines) + (panel if performance else 0)
    room = (height - fixed) if height else 26
    chart_height = max(min(room, 16), 8)
    small_height = max(min(room - chart_height, 10), 0)
    right = min(max(width // 3, 30), 44)
    left = width - right
    top = Table.grid()
    top.add_row(_loss_chart(snap, left, chart_height), _latest(snap, right, chart_height))
    parts: list[RenderableType] = [_header(snap), _progress(snap, width), top]
    if small_height >= 6:
        lr = Series("learning rate", *snap.series("learning_rate"), "green")
        throughput_key = "tokens_per_second" if snap.series("tokens_per_second")[1] else "samples_per_second"
        speed = Series(throughput_key.replace("_per_second", "/s"), *snap.series(throughput_key), "yellow")
        half = width // 2
        row = Table.grid()
        row.add_row(_small_chart("learning rate", [lr], half, small_height),
                    _small_chart("throughput", [speed], width - half, small_height))
        parts.append(row)
    if performance:
        parts.append(_performance(snap, width))
    parts.extend([_ranks(snap), _checkpoints(snap)])
    if snap.log_lines:
        parts.append(Text("\n".join(snap.log_lines[-3:]), style="dim"))
    parts.append(Text(f"read {time.strftime('%H:%M:%S', time.localtime(snap.now))}{footer}", style="dim"))
    return Group(*parts)
