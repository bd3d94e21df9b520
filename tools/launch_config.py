"""Run or check a paper-reproduction config from launch/configs/.

    python tools/launch_config.py launch/configs/pipeoffload_10.5b.yaml --dry-run            # full size
    python tools/launch_config.py launch/configs/pipeoffload_10.5b.yaml --scale tiny          # run on CPU
    python tools/launch_config.py launch/configs/pipeoffload_10.5b.yaml --variant po-h --set seq-length=16384 --dry-run

A config names the paper and the figure it reproduces, the values it had to assume, the cluster
(nodes x GPUs per node), the training script and its flags, one variant per compared method (flag
overrides, e.g. the schedule), and a `tiny` scale-down (process count and flag overrides) that runs on a
CPU in seconds. `--dry-run` validates every selected variant's flags for the stated world size (with
the same validation pretrain_*.py runs, so a config that would fail on the cluster fails here) and
prints the exact sbatch command (full size) or torchrun command (tiny). Without `--dry-run` the tiny
scale runs locally, one variant after another; the full size is submitted with sbatch by the user.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import yaml  # noqa: E402

from megatron_pp.cli import OneLineArgumentParser, UsageError  # noqa: E402

REQUIRED = ("paper", "reproduces", "assumed", "script", "cluster", "args", "variants", "tiny")


@dataclass
class Config:
    path: str
    paper: str
    reproduces: str
    assumed: list[str]
    script: str
    nodes: int
    gpus_per_node: int
    args: dict
    variants: dict[str, dict]
    tiny_nproc: int
    tiny_args: dict
    tiny_variants: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


def load_config(path: str) -> Config:
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except OSError as exc:
        raise UsageError(f"{path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise UsageError(f"{path}: not valid YAML ({' '.join(str(exc).split())})") from None
    if not isinstance(raw, dict):
        raise UsageError(f"{path}: expected a mapping at the top level")
    missing = [k for k in REQUIRED if k not in raw]
    unknown = sorted(set(raw) - set(REQUIRED))
    if missing or unknown:
        raise UsageError(f"{path}: " + "; ".join(
            ([f"missing keys {', '.join(missing)}"] if missing else []) + ([f"unknown keys {', '.join(unknown)}"] if unknown else [])))
    tiny = raw["tiny"] or {}
    return Config(
        path=path, paper=raw["paper"], reproduces=raw["reproduces"], assumed=list(raw["assumed"] or []),
        script=raw["script"], nodes=int(raw["cluster"]["nodes"]), gpus_per_node=int(raw["cluster"]["gpus_per_node"]),
        args=dict(raw["args"] or {}), variants={str(k): dict(v or {}) for k, v in (raw["variants"] or {}).items()},
        tiny_nproc=int(tiny.get("nproc", 2)), tiny_args=dict(tiny.get("args") or {}),
        tiny_variants=[str(v) for v in tiny.get("variants", [])],
    )


def to_flags(values: dict) -> list[str]:
    """{'seq-length': 8192, 'bf16': True, 'x': None} -> ['--seq-length', '8192', '--bf16']."""
    flags: list[str] = []
    for key, value in values.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return flags


def variant_flags(config: Config, variant: str, scale: str, sets: dict) -> list[str]:
    values = {**config.args, **config.variants[variant]}
    if scale == "tiny":
        values.update(config.tiny_args)
    values.update(sets)
    return to_flags(values)


@contextmanager
def _world(size: int) -> Iterator[None]:
    """Validation reads the world size from the launcher's variables: pretend to be rank 0 of it."""
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE")}
    os.environ.update(RANK="0", WORLD_SIZE=str(size))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def validate(config: Config, flags: Sequence[str], world: int, this_machine: bool) -> list[str]:
    from megatron_pp.training.arguments import build_parser, validate_args

    default = "llama-tiny" if "llama" in config.script else "gpt-tiny"
    with _world(world):
        try:
            args = build_parser().parse_args(list(flags))
        except UsageError as exc:
            return [str(exc)]
        if args.model_preset is None and args.num_layers is None:
            args.model_preset = default
        # The full size runs on the cluster: what it needs from a machine (CUDA, flash-attn) is not checked here.
        return validate_args(args, this_machine=this_machine)


def command(config: Config, flags: Sequence[str], scale: str) -> list[str]:
    if scale == "tiny":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                str(config.tiny_nproc), config.script, *flags]
    # Run from the repository root (the tiny scale does so itself).
    return ["sbatch", f"--nodes={config.nodes}", f"--gpus-per-node={config.gpus_per_node}",
            f"--ntasks-per-node={config.gpus_per_node}", "launch/slurm/pretrain.sbatch", config.script, *flags]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = OneLineArgumentParser(prog="launch_config.py", description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--scale", choices=("full", "tiny"), default="full")
    parser.add_argument("--variant", action="append", default=None, help="run/check only these variants")
    parser.add_argument("--set", action="append", default=[], metavar="FLAG=VALUE", help="override a flag")
    parser.add_argument("--dry-run", action="store_true")
    try:
        args = parser.parse_args(argv)
        config = load_config(args.config)
        sets = {}
        for item in args.set:
            if "=" not in item:
                raise UsageError(f"--set expects FLAG=VALUE, got {item!r}")
            key, value = item.split("=", 1)
            sets[key.lstrip("-")] = value
        chosen = args.variant or (config.tiny_variants if args.scale == "tiny" and config.tiny_variants else list(config.variants))
        unknown = [v for v in chosen if v not in config.variants]
        if unknown:
            raise UsageError(f"--variant {unknown[0]!r} is not in {args.config}; it has {', '.join(config.variants)}")
    except UsageError as exc:
        print(f"launch_config.py: error: {exc}", file=sys.stderr)
        return 2
    world = config.world_size if args.scale == "full" else config.tiny_nproc
    print(f"# {config.paper}\n# reproduces: {config.reproduces}")
    for item in config.assumed:
        print(f"# assumed: {item}")
    failed = False
    for variant in chosen:
        flags = variant_flags(config, variant, args.scale, sets)
        errors = validate(config, flags, world, this_machine=args.scale == "tiny")
        if errors:
            failed = True
            for line in errors:
                print(f"launch_config.py: error: {args.config} variant {variant}: {line}", file=sys.stderr)
            continue
        cmd = command(config, flags, args.scale)
        print(f"# variant {variant} ({args.scale}, {world} processes)\n{shlex.join(cmd)}")
        if not args.dry_run and args.scale == "tiny":
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            if subprocess.run(cmd, cwd=ROOT, env=env).returncode != 0:
                failed = True
    if not args.dry_run and args.scale == "full" and not failed:
        print("# full size: submit the sbatch commands above on the cluster")
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
