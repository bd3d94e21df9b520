"""Where the training loop's numbers go: console lines, a progress bar, JSONL, TensorBoard and wandb.

The loop hands one *row* (a flat dict) per iteration and one per evaluation to `MetricsLogger`, on the
logging rank only. Every sink gets every row: the `--metrics-file` JSONL file, TensorBoard scalars
(`--tensorboard-dir`) and wandb (`--wandb-project`). The console gets a Megatron-style line every
`--log-interval` iterations, averaged over the interval, and, only when stdout is a terminal, a
progress bar kept below the lines. TensorBoard and wandb take Megatron-LM's names for the scalars it
has (`lm loss`, `learning-rate`, `grad-norm`, `iteration-time`, ..., and on TensorBoard also `lm loss vs
samples` and the like), so a Megatron-LM run and ours overlay in one dashboard; what Megatron-LM has no
scalar for (peak stash per pipeline rank, MFU, communication wait) keeps the row's names beside them.
`tools/compare_runs.py` reads the JSONL file, a wandb run directory or a TensorBoard directory (ours or
Megatron-LM's) alike. A fresh run starts `--metrics-file` anew; a resumed one keeps the rows up to its
checkpoint. Training rows carry `loss`; evaluation rows carry `eval_loss` and
`eval_ppl` instead, so a reader can tell them apart by key.

wandb is imported only when asked for and runs offline unless `WANDB_API_KEY` is set and `WANDB_MODE`
is not `offline`: a cluster node without network then still gets a run directory that
`wandb sync` uploads later. The run's rows are also written to `files/metrics.jsonl` inside it.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import sys
import time
from typing import IO, Any, Mapping, Optional, Sequence

Row = dict[str, Any]


def take_peak_memory(device: Any) -> int:
    """Peak bytes the CUDA caching allocator handed out on `device` since the previous call, then reset,
    so each metrics row reports its own step's peak rather than the run's all-time high. 0 off CUDA."""
    import torch

    if getattr(device, "type", "cpu") != "cuda":
        return 0
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    return int(peak)


def flatten_row(row: Mapping[str, Any]) -> dict[str, float]:
    """Numeric scalars of a row; a list becomes `key/pp0`, `key/pp1`, ... (one per pipeline rank)."""
    flat: dict[str, float] = {}
    for key, value in row.items():
        if key == "iteration" or value is None or isinstance(value, (str, bool)):
            continue
        if isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if item is not None:
                    flat[f"{key}/pp{i}"] = float(item)
        else:
            flat[key] = float(value)
    return flat


def wandb_mode(environ: Mapping[str, str]) -> str:
    """'online' only with an API key and no request for offline (or disabled) mode."""
    requested = environ.get("WANDB_MODE", "").strip().lower()
    if requested in ("offline", "disabled", "dryrun"):
        return "disabled" if requested == "disabled" else "offline"
    return "online" if environ.get("WANDB_API_KEY") else "offline"


# Console ----------------------------------------------------------------------------------------------


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def format_train_line(rows: Sequence[Row], train_iters: int, log_throughput: bool) -> str:
    """One Megatron-style line summarising `rows` (the iterations since the previous line)."""
    last = rows[-1]
    finite = [r["loss"] for r in rows if math.isfinite(r["loss"])]
    nan_iterations = len(rows) - len(finite)
    parts = [
        f"iteration {last['iteration']:8d}/{train_iters:8d}",
        f"consumed samples: {last['consumed_samples']:12d}",
        f"elapsed time per iteration (ms): {1e3 * _mean([r['step_time_s'] for r in rows]):.1f}",
    ]
    if log_throughput:
        parts.append(f"throughput per GPU (TFLOP/s/GPU): {_mean([r['tflops_per_gpu'] for r in rows]):.3f}")
        mfus = [r["mfu"] for r in rows if r.get("mfu") is not None]
        if mfus:
            parts.append(f"MFU: {100 * _mean(mfus):.2f}%")
    parts += [
        f"tokens per second: {_mean([r['tokens_per_s'] for r in rows]):.0f}",
        f"learning rate: {last['lr']:.6E}",
        f"global batch size: {last['global_batch_size']:5d}",
        f"lm loss: {_mean(finite):.6E}",
        f"loss scale: {last['loss_scale']:.1f}",
        f"grad norm: {last['grad_norm']:.3f}",
        f"number of skipped iterations: {sum(bool(r['skipped']) for r in rows):3d}",
        f"number of nan iterations: {nan_iterations:3d}",
        f"peak stash (MB) per pp rank: {[round(b / 2**20, 2) for b in last['peak_stash_bytes']]}",
    ]
    return f" [{_now()}] " + " | ".join(parts) + " |"


def format_eval_line(row: Row) -> str:
    text = (f" validation loss at iteration {row['iteration']} | lm loss value: {row['eval_loss']:.6E} | "
            f"lm loss PPL: {row['eval_ppl']:.6E} |")
    rule = "-" * len(text)
    return f"{rule}\n{text}\n{rule}"


def _now() -> str:
    return datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")


class ProgressBar:
    """A one-line bar redrawn in place with carriage returns; lines printed through it go above it."""

    WIDTH = 30

    def __init__(self, total: int, stream: IO[str], start: int = 0) -> None:
        self.total = total
        self.stream = stream
        self.start = start
        self.done = start
        self.started = time.monotonic()

    def update(self, done: int) -> None:
        self.done = done
        self._draw()

    def print_above(self, text: str) -> None:
        self.stream.write("\r\x1b[K" + text + "\n")
        self._draw()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()

    def _draw(self) -> None:
        fraction = self.done / self.total if self.total else 1.0
        filled = int(self.WIDTH * fraction)
        elapsed = time.monotonic() - self.started
        steps = self.done - self.start
        rate = steps / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else math.inf
        eta_text = str(datetime.timedelta(seconds=round(eta))) if math.isfinite(eta) else "?"
        self.stream.write(f"\r\x1b[K[{'#' * filled}{'.' * (self.WIDTH - filled)}] {self.done}/{self.total} "
                          f"{rate:.2f} it/s ETA {eta_text}")
        self.stream.flush()


# Sinks ------------------------------------------------------------------------------------------------


MEGATRON_TENSORBOARD_NAMES = {
    "loss": "lm loss",
    "lr": "learning-rate",
    "grad_norm": "grad-norm",
    "step_time_s": "iteration-time",
    "loss_scale": "loss-scale",
    "global_batch_size": "batch-size",
    "eval_loss": "lm loss validation",
    "eval_ppl": "lm loss validation ppl",
    "tflops_per_gpu": "throughput",
}
"""Row keys that Megatron-LM writes to TensorBoard and wandb under another name: dashboards built for its
runs read ours. The other keys keep the row's own names beside them: what Megatron-LM has no scalar for
(`peak_stash_bytes/pp0`, ... per pipeline rank, `mfu`, `hfu`, `comm_wait_s`, `tokens_per_s`)."""

MEGATRON_VS_SAMPLES = ("lm loss", "learning-rate", "batch-size", "loss-scale", "grad-norm", "lm loss validation",
                       "lm loss validation ppl")
"""Scalars Megatron-LM also writes to TensorBoard against consumed samples, as `<name> vs samples`."""


def dashboard_scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """A row's scalars as dashboards see them: Megatron-LM's names where it has the scalar, else our own."""
    return {MEGATRON_TENSORBOARD_NAMES.get(key, key): value for key, value in flatten_row(row).items()}


class TensorBoardSink:
    def __init__(self, log_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when asked for

        self.writer = SummaryWriter(log_dir=log_dir)

    def write(self, row: Row) -> None:
        samples = row.get("consumed_samples")
        for name, value in dashboard_scalars(row).items():
            self.writer.add_scalar(name, value, row["iteration"])
            if samples is not None and name in MEGATRON_VS_SAMPLES:
                self.writer.add_scalar(f"{name} vs samples", value, samples)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, project: str, name: Optional[str], save_dir: str, config: Mapping[str, Any]) -> None:
        import wandb  # heavy, and starts a service process: only when asked for

        os.makedirs(save_dir, exist_ok=True)
        self.run = wandb.init(project=project, name=name, dir=save_dir, mode=wandb_mode(os.environ),
                              config=dict(config), settings=wandb.Settings(silent=True))
        # `run.dir` is the run's files/ directory: synced with the run, and what compare_runs reads.
        self.rows = open(os.path.join(self.run.dir, "metrics.jsonl"), "a")

    def write(self, row: Row) -> None:
        self.run.log(dashboard_scalars(row), step=row["iteration"])
        self.rows.write(json.dumps(row) + "\n")
        self.rows.flush()

    def close(self) -> None:
        self.rows.close()
        self.run.finish()


def open_metrics_file(path: str, resumed_at: Optional[int]) -> IO[str]:
    """The `--metrics-file` to append this run's rows to.

    A fresh run (`resumed_at` None) starts the file anew, so `tools/compare_runs.py` never reads two runs as
    one. A run resumed from the checkpoint of iteration N keeps the rows up to N and drops later ones (steps
    that ran after that checkpoint and will run again), rewritten atomically, then appends."""
    if resumed_at is None or not os.path.exists(path):
        return open(path, "w")
    kept = []
    with open(path) as f:
        for line in f:
            try:
                iteration = json.loads(line).get("iteration")
            except (json.JSONDecodeError, AttributeError):
                continue  # a line cut by a crash
            if isinstance(iteration, int) and iteration <= resumed_at:
                kept.append(line if line.endswith("\n") else line + "\n")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)
    return open(path, "a")


class MetricsLogger:
    """Every sink the arguments ask for, fed one row at a time by the logging rank."""

    def __init__(
        self,
        *,
        train_iters: int,
        log_interval: int,
        log_throughput: bool,
        metrics_file: Optional[str] = None,
        tensorboard_dir: Optional[str] = None,
        wandb_project: Optional[str] = None,
        wandb_exp_name: Optional[str] = None,
        wandb_save_dir: Optional[str] = None,
        run_config: Optional[Mapping[str, Any]] = None,
        stream: Optional[IO[str]] = None,
        resumed_at: Optional[int] = None,
    ) -> None:
        self.train_iters = train_iters
        self.log_interval = log_interval
        self.log_throughput = log_throughput
        self.stream = stream if stream is not None else sys.stdout
        self._pending: list[Row] = []
        self._file = open_metrics_file(metrics_file, resumed_at) if metrics_file else None
        self._sinks: list[Any] = []
        try:
            if tensorboard_dir:
                self._sinks.append(TensorBoardSink(tensorboard_dir))
            if wandb_project:
                self._sinks.append(WandbSink(wandb_project, wandb_exp_name, wandb_save_dir or "wandb",
                                             run_config or {}))
        except BaseException:
            self.close()
            raise
        is_tty = getattr(self.stream, "isatty", lambda: False)()
        self._bar = ProgressBar(train_iters, self.stream) if is_tty else None

    def start(self, iteration: int) -> None:
        """Training begins, or resumes after `iteration`: the progress bar's rate counts from here."""
        if self._bar is not None:
            self._bar = ProgressBar(self.train_iters, self.stream, iteration)

    def message(self, text: str) -> None:
        """A console line (kept above the progress bar)."""
        if self._bar is not None:
            self._bar.print_above(text)
        else:
            print(text, file=self.stream, flush=True)

    def train(self, row: Row) -> None:
        self._write(row)
        self._pending.append(row)
        iteration = row["iteration"]
        if iteration % self.log_interval == 0 or iteration == self.train_iters:
            self.message(format_train_line(self._pending, self.train_iters, self.log_throughput))
            self._pending = []
        if self._bar is not None:
            self._bar.update(iteration)

    def evaluation(self, row: Row) -> None:
        self._write(row)
        self.message(format_eval_line(row))

    def _write(self, row: Row) -> None:
        if self._file is not None:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
        for sink in self._sinks:
            sink.write(row)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        for sink in self._sinks:
            sink.close()
        self._sinks = []
        if getattr(self, "_bar", None) is not None:
            self._bar.close()
            self._bar = None
