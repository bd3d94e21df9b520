"""Checkpoints: per-rank shards plus a metadata file, written atomically and loaded without pickle code.

A checkpoint holds everything a resumed run needs to continue *exactly* as if never stopped: model
weights, optimizer state (with the loss scaler and fp32 main weights, whatever `optimizer.state_dict()`
returns), the LR schedule's state, every rank's random-number generators (Python, NumPy, torch CPU and
CUDA, and the tensor-parallel RNG tracker's streams), the data position (consumed samples) and a
schedule-specific dict for schedules that carry state across steps (2BW's older weight version).
Layout of `--save DIR`, for tp=2, pp=2, one chunk per rank, dp=1:

    DIR/latest_checkpointed_iteration.txt   "200": the newest complete checkpoint, written last
    DIR/iter_0000200/
        metadata.json                       iteration, consumed samples, layout, schedule, model config
        model_stage000_tp00.pt              weights of global pipeline stage 0, tensor-parallel shard 0
        model_stage000_tp01.pt  model_stage001_tp00.pt  model_stage001_tp01.pt
        optim_pp000_tp00_dp000.pt           optimizer + LR schedule state of pipeline rank 0, tp rank 0
        ...                                 (one per dp rank with the distributed optimizer, else dp 0's)
        rank_pp000_tp00_dp000.pt            RNG states and schedule state of that rank (every rank)
    DIR/iter_0000300.tmp/                   a save in progress, or one killed midway: never loaded

Model shards are keyed by *global stage*, not by pipeline rank, so any schedule with the same layer split
loads them: 1F1B and GPipe share files, and so do pp=2 with 2 chunks per rank and pp=4 with one. The
optimizer and RNG files belong to ranks and need the same tp, pp and placement (and dp for the
distributed optimizer); otherwise load with `--no-load-optim --no-load-rng`. Another tensor-parallel
size or layer split is refused with a one-line error: resharding is the conversion tool's job.

Atomicity: every rank writes into `iter_N.tmp/`; a barrier; rank 0 writes `metadata.json`, renames
the directory to `iter_N/` and only then replaces the tracker file (temporary file + `os.replace`).
Files and directories are fsynced before each rename, so a crash at any point leaves the tracker on
the previous complete checkpoint. A rank that fails to write or read tells the others through an
all-reduce, so every rank raises instead of waiting forever at the next collective; a failed write
(a full disk) removes its `iter_N.tmp/`. Files are loaded with `weights_only=True`: a file holding
anything but tensors and plain values is refused, never executed (docs/reliability.md).
"""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
import random
import shutil
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence

import numpy as np
import torch
from torch import nn

from megatron_pp.core import comm
from megatron_pp.core.parallel_state import ParallelState
from megatron_pp.core.tensor_parallel import get_rng_tracker
from megatron_pp.models.config import TransformerConfig
from megatron_pp.models.layout import StageSpec

FORMAT_VERSION = 1
TRACKER_FILE = "latest_checkpointed_iteration.txt"
METADATA_FILE = "metadata.json"
CONVERT_HINT = "loading into another tensor-parallel size or layer split is the checkpoint conversion tool's job"

# Fields that decide the shape of some parameter: a checkpoint that differs in one of them cannot load.
# Numerics that do not (dropout, norm epsilon, RoPE base, init std, attention backend, dtype) may change.
# The vocabulary counts through its padded size, which also depends on tp (checked with the layout).
SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "query_groups", "head_dim", "ffn_size",
                "vocab_size", "make_vocab_size_divisible_by", "normalization", "activation",
                "position_embedding_type", "add_bias_linear", "untie_embeddings_and_output_weights")


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or loaded; the message says which and why, in one line."""


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class TrainingState:
    """What one rank saves and restores: its model chunks and their place in the job."""

    chunks: Sequence[nn.Module]
    stage_ids: Sequence[int]
    """Global pipeline stage of each chunk."""
    stages: Sequence[StageSpec]
    """The layer split of the whole model (every global stage)."""
    placement: Sequence[tuple[int, int]]
    """(pipeline rank, chunk) of every global stage, from the schedule."""
    state: ParallelState
    config: TransformerConfig
    schedule_name: str
    optimizer: Optional[Stateful] = None
    optimizer_sharded_by_dp: bool = False
    """True with the distributed optimizer: each dp rank then saves and loads its own optimizer file."""


@dataclass(frozen=True)
class Resume:
    """Where a loaded checkpoint puts the run."""

    iteration: int
    consumed_samples: int
    schedule_state: dict
    path: str


# Names ------------------------------------------------------------------------------------------------


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def model_file(stage: int, tp_rank: int) -> str:
    return f"model_stage{stage:03d}_tp{tp_rank:02d}.pt"


def optimizer_file(pp_rank: int, tp_rank: int, dp_rank: int) -> str:
    return f"optim_pp{pp_rank:03d}_tp{tp_rank:02d}_dp{dp_rank:03d}.pt"


def rank_file(pp_rank: int, tp_rank: int, dp_rank: int) -> str:
    return f"rank_pp{pp_rank:03d}_tp{tp_rank:02d}_dp{dp_rank:03d}.pt"


def read_tracker(root: str) -> Optional[int]:
    """The iteration of the newest complete checkpoint under `root`, or None when there is none."""
    path = os.path.join(root, TRACKER_FILE)
    try:
        with open(path) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    if not text.isdigit():
        raise CheckpointError(f"{path}: expected an iteration number, found {text[:40]!r}")
    return int(text)


# Pieces of state --------------------------------------------------------------------------------------


def capture_rng_state() -> dict:
    """Every generator this process draws from, as plain tensors and numbers (weights_only-loadable)."""
    kind, keys, position, has_gauss, cached_gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                  "has_gauss": int(has_gauss), "cached_gauss": float(cached_gauss)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": get_rng_tracker().get_states(),
    }


def restore_rng_state(saved: dict) -> None:
    random.setstate(saved["python"])
    numpy = saved["numpy"]
    np.random.set_state((numpy["kind"], numpy["keys"].numpy().astype(np.uint32), numpy["position"],
                         numpy["has_gauss"], numpy["cached_gauss"]))
    torch.set_rng_state(saved["torch"])
    if saved["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(saved["cuda"])
    get_rng_tracker().set_states(saved["tracker"])


def model_shape(config: TransformerConfig) -> dict[str, Any]:
    """The config values that fix parameter shapes, given the tensor-parallel size."""
    shape = {name: getattr(config, name) for name in SHAPE_FIELDS}
    if config.position_embedding_type == "learned_absolute":
        shape["num_positions"] = config.num_positions
    return shape


def _layout(train: TrainingState) -> dict[str, Any]:
    state = train.state
    return {"tp": state.tp_size, "pp": state.pp_size, "dp": state.dp_size,
            "num_chunks": len(train.chunks), "placement": [list(p) for p in train.placement],
            "stages": [dataclasses.asdict(s) for s in train.stages]}


def config_to_json(config: TransformerConfig) -> dict[str, Any]:
    """The config as JSON values (the dtype as its name, e.g. "torch.bfloat16"), as metadata.json holds it."""
    values = dataclasses.asdict(config)
    values["params_dtype"] = str(config.params_dtype)
    return values


def config_from_json(values: dict[str, Any]) -> TransformerConfig:
    """Inverse of `config_to_json`; a field this code does not know is an error, not silently dropped."""
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise CheckpointError(f"the checkpoint's model config has fields this version does not know: "
                              f"{', '.join(unknown)}")
    values = dict(values)
    dtype_name = str(values.pop("params_dtype", "torch.float32")).removeprefix("torch.")
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"the checkpoint's model config has an unknown params_dtype {dtype_name!r}")
    return TransformerConfig(**values, params_dtype=dtype)


# Writing ----------------------------------------------------------------------------------------------


def fsync_dir(path: str) -> None:
    """Make a rename or a new file in `path` durable (a directory entry is data of the directory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str, value: Any) -> None:
    """Write `value` as indented JSON and fsync it (non-JSON values, e.g. dtypes, as their str)."""
    with open(path, "w") as f:
        json.dump(value, f, indent=1, default=str)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


# Called with each shard's path before it is written; fault injection uses it to simulate a full disk or
# a rank killed mid-save (`training.faults`). None in normal runs.
_write_hook: Optional[Callable[[str], None]] = None


def set_write_hook(hook: Optional[Callable[[str], None]]) -> Optional[Callable[[str], None]]:
    """Install `hook` (see `_write_hook`); returns the previous one so a caller can put it back."""
    global _write_hook
    previous, _write_hook = _write_hook, hook
    return previous


def _save_file(obj: Any, path: str) -> None:
    if _write_hook is not None:
        _write_hook(path)
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def write_text_atomic(path: str, text: str) -> None:
    """Replace `path` with `text` so that a reader sees the old content or the new, never a mix."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def _agree(error: Optional[BaseException], action: str) -> None:
    """Raise on every rank if `error` happened on any rank (a max all-reduce of a failure flag)."""
    failed = comm.all_reduce(torch.tensor([0.0 if error is None else 1.0]), op="max")
    if error is not None:
        if isinstance(error, CheckpointError):
            raise error
        raise CheckpointError(f"{action}: {type(error).__name__}: {error}".replace("\n", " ")) from error
    if failed.item() > 0:
        echo = CheckpointError(f"{action} failed on another rank (see its error)")
        echo.echo = True  # type: ignore[attr-defined]  # that rank prints the cause; see training.errors
        raise echo


def _run_agreed(action: str, fn: Callable[[], Any]) -> Any:
    try:
        result = fn()
    except Exception as exc:  # any failure (I/O, unpickling, shapes) must reach the other ranks
        _agree(exc, action)
        raise  # unreachable: _agree raises
    _agree(None, action)
    return result


def save_checkpoint(
    root: str,
    iteration: int,
    train: TrainingState,
    *,
    consumed_samples: int,
    schedule_state: Optional[dict] = None,
    save_optimizer: bool = True,
    extra_metadata: Optional[dict] = None,
) -> str:
    """Write the checkpoint of `iteration` under `root` (collective: every rank calls it). Returns its dir."""
    state = train.state
    final = iteration_dir(root, iteration)
    tmp = final + ".tmp"

    def prepare() -> None:
        if state.rank == 0:
            os.makedirs(root, exist_ok=True)
            if os.path.exists(tmp):  # a previous attempt at this iteration died midway
                shutil.rmtree(tmp)
            os.makedirs(tmp)

    # Each agreement is also the barrier between the phases: nobody writes before the directory exists,
    # rank 0 publishes only once every rank has written, and nobody returns before the tracker moved.
    _run_agreed(f"creating {tmp}", prepare)

    def write_shards() -> None:
        coords = state.coords
        if coords.dp == 0:
            for stage, chunk in zip(train.stage_ids, train.chunks):
                _save_file({"model": chunk.state_dict()}, os.path.join(tmp, model_file(stage, coords.tp)))
        if save_optimizer and train.optimizer is not None and (coords.dp == 0 or train.optimizer_sharded_by_dp):
            _save_file(
                {"optimizer": train.optimizer.state_dict()},
                os.path.join(tmp, optimizer_file(coords.pp, coords.tp, coords.dp)),
            )
        _save_file({"rng": capture_rng_state(), "schedule_state": schedule_state or {}},
                   os.path.join(tmp, rank_file(coords.pp, coords.tp, coords.dp)))

    try:
        _run_agreed(f"saving checkpoint {final}", write_shards)
    except CheckpointError:
        # A full disk stays full while the half-written shards sit there; the tracker never pointed at
        # them, so removing them loses nothing. Best effort: the original error is the one to report.
        if state.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise

    def publish() -> None:
        if state.rank != 0:
            return
        metadata = {
            "format_version": FORMAT_VERSION,
            "iteration": iteration,
            "consumed_samples": consumed_samples,
            "world_size": state.world_size,
            "layout": _layout(train),
            "schedule": train.schedule_name,
            "model": config_to_json(train.config),
            "model_shape": model_shape(train.config),
            "optimizer": {"saved": save_optimizer and train.optimizer is not None,
                          "sharded_by_dp": train.optimizer_sharded_by_dp},
            **(extra_metadata or {}),
        }
        write_json(os.path.join(tmp, METADATA_FILE), metadata)
        fsync_dir(tmp)
        if os.path.exists(final):
            # Re-saving an iteration (a run resumed from an earlier one): the tracker does not point at
            # `final` (it would have been loaded), so replacing it never orphans the tracker.
            stale = f"{final}.old.{os.getpid()}"
            os.rename(final, stale)
            os.rename(tmp, final)
            shutil.rmtree(stale)
        else:
            os.rename(tmp, final)
        fsync_dir(root)
        write_text_atomic(os.path.join(root, TRACKER_FILE), f"{iteration}\n")

    _run_agreed(f"publishing checkpoint {final}", publish)
    return final


# Reading ----------------------------------------------------------------------------------------------


def load_shard(path: str, device: torch.device | str) -> dict:
    """One checkpoint file, tensors and plain values only (weights_only); any failure is a one-line
    CheckpointError naming the file."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing from the checkpoint")
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as exc:
        # weights_only: only tensors and plain containers unpickle; anything that would import or call
        # code (a crafted file, or a checkpoint of another program) is refused, never executed.
        reason = " ".join(str(exc).split())[:200]
        raise CheckpointError(f"{path}: refused to load (holds objects other than tensors and plain values; "
                              f"weights_only unpickler: {reason})") from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        reason = " ".join(str(exc).split())[:200]
        raise CheckpointError(f"{path}: unreadable ({type(exc).__name__}: {reason}); the file is damaged or "
                              "truncated") from None


def read_metadata(directory: str) -> dict:
    path = os.path.join(directory, METADATA_FILE)
    try:
        with open(path) as f:
            metadata = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (not a checkpoint directory, or a damaged one)") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    version = metadata.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {version!r}, this code reads {FORMAT_VERSION}")
    return metadata


def check_compatible(metadata: dict, train: TrainingState, directory: str) -> None:
    """Raise a one-line CheckpointError if the model or the tp/layer split differs from this run's."""
    ours = model_shape(train.config)
    theirs = metadata["model_shape"]
    differences = [f"{key} {theirs.get(key)!r} (checkpoint) vs {ours.get(key)!r} (this run)"
                   for key in sorted(set(ours) | set(theirs)) if ours.get(key) != theirs.get(key)]
    if differences:
        raise CheckpointError(f"{directory} holds a different model: {'; '.join(differences)}")
    layout = metadata["layout"]
    stages = [dataclasses.asdict(s) for s in train.stages]
    if layout["tp"] != train.state.tp_size or layout["stages"] != stages:
        def split(entries: list[dict]) -> str:
            return "[" + ", ".join(f"{s['layer_start']}-{s['layer_end']}" for s in entries) + "]"

        raise CheckpointError(
            f"{directory} was saved with --tensor-model-parallel-size {layout['tp']} and layers per stage "
            f"{split(layout['stages'])}; this run has {train.state.tp_size} and {split(stages)}: {CONVERT_HINT}"
        )


def _same_ranks(metadata: dict, train: TrainingState) -> bool:
    layout = metadata["layout"]
    return layout["pp"] == train.state.pp_size and layout["placement"] == [list(p) for p in train.placement]


def load_checkpoint(
    root: str,
    train: TrainingState,
    *,
    load_optimizer: bool = True,
    load_rng: bool = True,
    finetune: bool = False,
    exit_on_missing: bool = False,
) -> Optional[Resume]:
    """Restore the newest checkpoint under `root` into `train` (collective). None: start from scratch.

    Megatron's semantics: a missing checkpoint starts from scratch unless `exit_on_missing` or
    `finetune`; `finetune` loads the weights only and starts at iteration 0 with fresh optimizer, RNG
    and data position. Every step runs under one agreement, so a problem seen by any rank (a file
    missing on one node's view of the filesystem) stops all of them.
    """
    load_optimizer = load_optimizer and not finetune
    load_rng = load_rng and not finetune
    return _run_agreed(f"--load {root}",
                       lambda: _restore(root, train, load_optimizer, load_rng, finetune, exit_on_missing))


def _restore(root: str, train: TrainingState, load_optimizer: bool, load_rng: bool, finetune: bool,
             exit_on_missing: bool) -> Optional[Resume]:
    iteration = read_tracker(root) if os.path.isdir(root) else None
    if iteration is None:
        if exit_on_missing or finetune:
            flag = "--exit-on-missing-checkpoint" if exit_on_missing else "--finetune"
            raise CheckpointError(f"--load {root}: no checkpoint found ({TRACKER_FILE} missing) and {flag} was given")
        return None
    directory = iteration_dir(root, iteration)
    if not os.path.isdir(directory):
        raise CheckpointError(f"{os.path.join(root, TRACKER_FILE)} names iteration {iteration}, but {directory} "
                              "does not exist")
    metadata = read_metadata(directory)
    check_compatible(metadata, train, directory)
    load_optimizer = load_optimizer and train.optimizer is not None
    same_ranks = _same_ranks(metadata, train)
    if (load_optimizer or load_rng) and not same_ranks:
        layout = metadata["layout"]
        raise CheckpointError(
            f"{directory} was saved with --pipeline-model-parallel-size {layout['pp']} and stage placement "
            f"{layout['placement']}: its weights load into this run, but its optimizer and RNG states belong "
            f"to other ranks; add --no-load-optim --no-load-rng"
        )
    if load_optimizer:
        _check_optimizer_state(metadata, train, directory)

    coords, device = train.state.coords, train.state.device
    for stage, chunk in zip(train.stage_ids, train.chunks):
        chunk.load_state_dict(load_shard(os.path.join(directory, model_file(stage, coords.tp)), device)["model"])
    if load_optimizer:
        dp = coords.dp if train.optimizer_sharded_by_dp else 0
        saved = load_shard(os.path.join(directory, optimizer_file(coords.pp, coords.tp, dp)), device)
        train.optimizer.load_state_dict(saved["optimizer"])
    if finetune:
        return Resume(0, 0, {}, directory)
    schedule_state: dict = {}
    if same_ranks:
        # dp replicas draw identical random streams (seeded by tp and pp rank only): after a change of
        # data-parallel size a new replica takes replica 0's state.
        dp = coords.dp if coords.dp < metadata["layout"]["dp"] else 0
        path = os.path.join(directory, rank_file(coords.pp, coords.tp, dp))
        # A converted checkpoint has weights only: without RNG to restore, a missing file is fine.
        if load_rng or os.path.isfile(path):
            saved = load_shard(path, "cpu")
            if load_rng:
                restore_rng_state(saved["rng"])
            schedule_state = saved["schedule_state"]
    return Resume(iteration, int(metadata["consumed_samples"]), schedule_state, directory)


def _check_optimizer_state(metadata: dict, train: TrainingState, directory: str) -> None:
    saved = metadata["optimizer"]
    if not saved["saved"]:
        raise CheckpointError(f"{directory} has no optimizer state (saved with --no-save-optim); "
                              "add --no-load-optim or --finetune")
    if saved["sharded_by_dp"] != train.optimizer_sharded_by_dp or (
            train.optimizer_sharded_by_dp and metadata["layout"]["dp"] != train.state.dp_size):
        raise CheckpointError(
            f"{directory} holds optimizer state for data-parallel size {metadata['layout']['dp']} "
            f"({'distributed' if saved['sharded_by_dp'] else 'replicated'} optimizer); "
            f"this run cannot load it directly: add --no-load-optim"
        )
