"""Random-number streams that agree across TP ranks where they must and differ where they must.

Dropout on a tensor that every TP rank holds in full (the residual stream without sequence parallelism)
must draw the same mask on every rank, or the replicas drift apart; dropout on a tensor that is split
across the TP group (attention probabilities of this rank's heads, or the residual stream's rows under
sequence parallelism) must draw different masks, or every shard repeats the same pattern. The default
torch generator serves the first case; `RNGTracker` keeps named extra generator states and `fork(name)`
swaps one in for the duration of a `with` block (CPU and, when present, the current CUDA device), then
puts the default back. `model_parallel_seed` sets both up:

    default generator       seed + 1000 * pp_rank                      same on all TP ranks of a stage
    "tensor-parallel-rng"   seed + 1_000_000 + 1000 * pp_rank + tp_rank  different on every TP rank

States are plain tensors in plain dicts (`get_states`, `get_default_rng_state`), so checkpoints load
with `torch.load(weights_only=True)` and activation recomputation can replay a forward's exact masks.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

TENSOR_PARALLEL_RNG = "tensor-parallel-rng"

# Seed offsets keep the streams of all (tp, pp) coordinates distinct for tp, pp < _COORD_LIMIT.
_COORD_LIMIT = 1000
_TENSOR_PARALLEL_OFFSET = 1_000_000

RNGState = dict[str, torch.Tensor]  # {"cpu": ByteTensor, "cuda": ByteTensor (only with CUDA)}


def get_default_rng_state() -> RNGState:
    """The default generators' state: CPU, and the current CUDA device's when CUDA is available."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_default_rng_state(state: RNGState) -> None:
    """Restore what `get_default_rng_state` returned."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _seeded_state(seed: int) -> RNGState:
    """The state of a fresh generator seeded with `seed`, without touching the default generators."""
    cpu = torch.Generator()
    cpu.manual_seed(seed)
    state = {"cpu": cpu.get_state()}
    if torch.cuda.is_available():
        cuda = torch.Generator(device=torch.device("cuda", torch.cuda.current_device()))
        cuda.manual_seed(seed)
        state["cuda"] = cuda.get_state()
    return state


class RNGTracker:
    """Named generator states that can be swapped in for the default generator. Usage:

        tracker = RNGTracker()
        tracker.add("tensor-parallel-rng", 1234 + tp_rank)
        with tracker.fork("tensor-parallel-rng"):
            probs = torch.nn.functional.dropout(probs, 0.1)   # a different mask on each TP rank
    """

    def __init__(self) -> None:
        self._states: dict[str, RNGState] = {}
        self._seeds: dict[int, str] = {}

    def reset(self) -> None:
        self._states.clear()
        self._seeds.clear()

    def __contains__(self, name: str) -> bool:
        return name in self._states

    def add(self, name: str, seed: int) -> None:
        """Create the state `name`, seeded with `seed`. The default generators are not touched."""
        if name in self._states:
            raise ValueError(f"RNG state {name!r} already exists")
        if seed in self._seeds:
            # Two names with one seed would produce the very same masks, silently.
            raise ValueError(f"seed {seed} for RNG state {name!r} is already used by {self._seeds[seed]!r}")
        self._states[name] = _seeded_state(seed)
        self._seeds[seed] = name

    @contextlib.contextmanager
    def fork(self, name: str = TENSOR_PARALLEL_RNG) -> Iterator[None]:
        """Draw from state `name` inside the block; the default generators resume where they were."""
        if name not in self._states:
            raise KeyError(f"RNG state {name!r} was never added (known: {sorted(self._states)}); "
                           "call model_parallel_seed or RNGTracker.add first")
        outside = get_default_rng_state()
        set_default_rng_state(self._states[name])
        try:
            yield
        finally:
            # Keep how far the named stream advanced, so the next fork continues it.
            self._states[name] = get_default_rng_state()
            set_default_rng_state(outside)

    def get_states(self) -> dict[str, RNGState]:
        """A copy of every named state (for checkpoints and activation recomputation)."""
        return _copy_states(self._states)

    def set_states(self, states: dict[str, RNGState]) -> None:
        """Replace the named states with `states` (as returned by `get_states`)."""
        self._states = _copy_states(states)
        self._seeds = {seed: name for seed, name in self._seeds.items() if name in self._states}


def _copy_states(states: dict[str, RNGState]) -> dict[str, RNGState]:
    """Generator states are host data: copied outside any fake-tensor mode, so that a forward recomputed
    in the dry run (full recompute with dropout) restores real states, not fake copies it cannot load."""
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        return {name: {k: v.clone() for k, v in state.items()} for name, state in states.items()}


_DEFAULT_TRACKER = RNGTracker()


def get_rng_tracker() -> RNGTracker:
    """The process-wide tracker, for code that does not carry its own."""
    return _DEFAULT_TRACKER


def model_parallel_seed(seed: int, tp_rank: int, pp_rank: int, tracker: Optional[RNGTracker] = None) -> None:
    """Seed the default generators and reset `tracker` (default: the process-wide one) for this rank.

    The default generators get `seed + 1000 * pp_rank` (equal across TP ranks, different per pipeline
    stage so stages do not repeat each other's masks); `tracker` gets a `"tensor-parallel-rng"` state
    seeded `seed + 1_000_000 + 1000 * pp_rank + tp_rank`.
    """
    for what, value in (("tp_rank", tp_rank), ("pp_rank", pp_rank)):
        if not 0 <= value < _COORD_LIMIT:
            raise ValueError(f"{what} {value} outside [0, {_COORD_LIMIT}): seed offsets would collide")
    tracker = _DEFAULT_TRACKER if tracker is None else tracker
    default_seed = seed + _COORD_LIMIT * pp_rank
    torch.manual_seed(default_seed)
    tracker.reset()
    tracker.add(TENSOR_PARALLEL_RNG, default_seed + _TENSOR_PARALLEL_OFFSET + tp_rank)
