"""Mutation check: plant small bugs in the modules that carry numbers and see whether the tests notice.

    python dev/mutation_check.py --sample 40 --seed 23 --timeout 900 --out docs/results/mutation_seed23.json
    python dev/mutation_check.py --only megatron_pp/core/grads.py:253:25:cmp   # re-run chosen mutants
    python dev/mutation_check.py --list                                         # count mutants per module
    python dev/mutation_check.py --annotate docs/results/mutation.json --notes docs/results/mutation_notes.json
    python dev/mutation_check.py --since 9821f81 --sample 24 --seed 1      # only lines changed since a commit

Each mutant changes one spot of one module in a private copy of the repository (the working tree is
never touched; by default the copy is the committed HEAD, extracted with `git archive` when the run starts,
so edits others make meanwhile, committed or not, never meet a mutant; `--worktree` copies the working tree
as it is): a comparison flipped at its boundary (`<` <-> `<=`, `>` <-> `>=`, `==` <-> `!=`), an
integer constant moved by +1 or -1, `and` <-> `or`, or a statement (a call, an assignment) replaced by
`pass`. The tests that cover the module (`COVERING`) then run in a fresh pytest process with
`-x`, under a per-mutant time limit; a failure or a time-out kills the mutant. Mutants inside
f-strings, docstrings and annotations are not generated.

The report (`--out`) has the integer fields `total`, `killed`, `equivalent` and `non_equivalent`
(total minus equivalent; the score is killed / non_equivalent) and one entry per survivor: file:line,
operator and the mutated line, plus what `--notes FILE` says about it: `killed_by` (a test written
since, checked with `--only`), `equivalent` (why no test can tell the mutant from the original),
`fixed` (looking into it found a bug at its spot, fixed since; it stays a survivor in the
score) or `open` (understood, not equivalent, not killed: why). A survivor without a note is listed as unexplained; `--annotate` applies new
notes to a report without running anything. A full run takes hours on a small
machine; `--sample N --seed S` runs a reproducible random subset.

`--since COMMIT` plants mutants only on the lines a change added or rewrote: the lines `git diff -U0 -M
COMMIT HEAD` marks as new (with `--worktree`, the working tree's). A moved file counts only its edited
lines; code moved between two files counts as new in the file it went to. So a round's changes are held to the standard of the
whole. The report then records the commit and the changed modules the map has no tests for
(`changed_unmapped`), which no mutant can measure. Every report records what its mutants were drawn from
(`population`: mutants and modules, as `--list` counts them), and is rewritten after each mutant, marked
`partial` until the run ends.
"""
from __future__ import annotations

import ast
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_pp.cli import ExitingArgumentParser, write_json  # noqa: E402

EDGES = "tests/training/test_exactness_edges.py"
SAFETY = "tests/reliability/test_safety.py"
# The argument parser's modules (flags, config files, the job's schedule, the checks) share their tests.
ARGUMENT_TESTS = ["tests/training/test_arguments.py", "tests/training/test_argument_properties.py",
                  f"{SAFETY}::test_config_files_cannot_send_outputs_outside_the_run_directory",
                  f"{SAFETY}::test_relative_outputs_in_config_files_and_any_path_on_the_command_line_are_fine",
                  f"{EDGES}::test_refused_combinations_name_their_flags",
                  # Megatron-LM's rule that --sequence-parallel is off at tensor-parallel size 1 (derive_args)
                  "tests/training/test_megatron_lm_scripts.py::test_llama_script_trains_shrunk_through_pretrain_gpt"]
SIZES = "tests/schedules/test_generators.py::test_every_generator_refuses_sizes_that_are_not_positive_ints_naming_the_argument"
# Module -> the tests that cover it (pytest arguments: files or node ids).
COVERING: dict[str, list[str]] = {
    "megatron_pp/schedules/generators.py": ["tests/schedules/test_generators.py", "tests/schedules/test_simulate.py"],
    "megatron_pp/schedules/looped.py": [SIZES, "tests/schedules/test_looped.py"],
    "megatron_pp/schedules/gis.py": [SIZES, "tests/schedules/test_gis.py"],
    "megatron_pp/schedules/zero_bubble.py": [SIZES, "tests/schedules/test_zero_bubble.py"],
    "megatron_pp/schedules/vshape.py": [SIZES, "tests/schedules/test_vshape.py"],
    "megatron_pp/schedules/offload.py": ["tests/schedules/test_offload.py"],
    "megatron_pp/schedules/bpipe.py": ["tests/schedules/test_bpipe.py"],
    "megatron_pp/schedules/twobw.py": [SIZES, "tests/schedules/test_2bw.py"],
    # BPipe's parking links and its acceptor's side (add_hosting) are inserted here too; the V shapes are the
    # lists that send both ways on one link (SEND_F and SEND_B sharing its counter).
    "megatron_pp/schedules/comm.py": ["tests/schedules/test_comm.py", "tests/schedules/test_validate.py",
                                      "tests/schedules/test_generators.py", "tests/schedules/test_gis.py",
                                      "tests/schedules/test_bpipe.py", "tests/schedules/test_vshape.py"],
    # 2BW's lists are the only ones that live through more than two weight versions; the parking links' rules
    # are tested on BPipe's lists.
    "megatron_pp/schedules/validate.py": ["tests/schedules/test_validate.py", "tests/schedules/test_generators.py",
                                          "tests/schedules/test_looped.py", "tests/schedules/test_2bw.py",
                                          "tests/schedules/test_bpipe.py"],
    # Stash transfers (OFFLOAD/RELOAD, EVICT/LOAD) are timed only in the PipeOffload and BPipe tests; an
    # acceptor that waits for room (its guest cap) only over a pair link slower than a stage's compute, which
    # the BPipe estimator's network test runs (it killed the seed-41 survivor, the cap tested at `<=`).
    "megatron_pp/schedules/simulate.py": ["tests/schedules/test_simulate.py",
                                          "tests/schedules/test_simulate_properties.py",
                                          "tests/schedules/test_offload.py", "tests/schedules/test_bpipe.py",
                                          "tests/planning/test_bpipe_estimator.py::test_transfers_over_the_network_are_charged"],
    # Split backward, offload and BPipe run handlers that plain 1F1B never calls.
    "megatron_pp/schedules/execute.py": ["tests/schedules/test_exactness.py::test_exact_world2",
                                         f"{EDGES}::test_one_step_gradients_at_odd_sizes",
                                         "tests/schedules/test_exactness.py::test_exact_zero_bubble_world2",
                                         "tests/schedules/test_exactness.py::test_exact_pipeoffload_world2",
                                         "tests/schedules/test_exactness.py::test_exact_bpipe[gpt-tiny-tp1-pp4-m4]",
                                         "tests/schedules/test_execute.py",
                                         "tests/core/test_split_backward.py",
                                         "tests/core/test_p2p.py",
                                         "tests/schedules/test_offload_exec.py"],
    "megatron_pp/schedules/store.py": ["tests/schedules/test_store.py", "tests/schedules/test_offload_store.py",
                                       "tests/schedules/test_exactness.py::test_measured_stash_peaks_match_simulator",
                                       "tests/core/test_split_backward.py",
                                       "tests/models/test_recompute.py"],
    "megatron_pp/schedules/offload_store.py": ["tests/schedules/test_offload_store.py",
                                               "tests/schedules/test_offload_exec.py"],
    "megatron_pp/schedules/peer_store.py": ["tests/schedules/test_bpipe_exec.py"],
    # test_grad_reduce.py runs the tied embedding at every placement: across two ranks (interleaved) and
    # with both ends on rank 0 (zb-v, v-half), where a wrong plan once hung rank 0 alone in the embedding sum.
    "megatron_pp/core/grads.py": ["tests/core/test_coalesced.py", "tests/core/test_grad_reduce.py", "tests/core/test_shards_dp3.py",
                                  "tests/core/test_main_grad.py", EDGES,
                                  "tests/core/test_grad_norm.py"],
    # bf16 reduction buffers (--grad-reduce-in-bf16) are the only case whose main gradients are fp32 copies.
    "megatron_pp/core/distributed_optimizer.py": ["tests/training/test_distributed_optimizer_bf16.py",
                                                  "tests/training/test_optimizer.py", EDGES,
                                                  "tests/core/test_distributed_optimizer_overlap.py",
                                                  "tests/training/test_overlap_param_gather.py"],
    "megatron_pp/core/layered_grads.py": ["tests/core/test_layered_grads.py", EDGES],
    "megatron_pp/core/sharded_weights.py": ["tests/core/test_sharded_weights.py", "tests/core/test_shards_dp3.py",
                                            EDGES],
    "megatron_pp/training/optimizer.py": ["tests/training/test_optimizer.py", "tests/training/test_optimizer_config_checks.py",
                                          "tests/training/test_loss_scaler.py",
                                          "tests/training/test_argument_properties.py",
                                          "tests/schedules/test_looped_exec.py"],
    "megatron_pp/training/layered.py": ["tests/schedules/test_looped_exec.py", EDGES],
    "megatron_pp/training/train.py": ["tests/training/test_train.py", "tests/training/test_flops.py",
                                      "tests/training/test_pretrain.py", EDGES,
                                      "tests/training/test_logging.py",
                                      "tests/reliability/test_bad_input.py",
                                      "tests/training/test_offload_probe.py",
                                      SAFETY],
    "megatron_pp/training/twobw.py": ["tests/training/test_2bw.py", "tests/training/test_2bw_resume.py"],
    "megatron_pp/training/step.py": ["tests/training/test_step_metrics.py", EDGES, "tests/training/test_pretrain.py"],
    "megatron_pp/training/step_data.py": [EDGES, "tests/training/test_argument_properties.py",
                                          "tests/training/test_pretrain.py"],
    "megatron_pp/training/trainer.py": ["tests/reliability/test_numerics.py", "tests/training/test_pretrain.py",
                                        "tests/training/test_evaluation.py",
                                        EDGES,
                                        "tests/training/test_trainer.py",
                                        "tests/training/test_logging.py",
                                        "tests/training/test_checkpointing.py",
                                        "tests/training/test_2bw_resume.py",
                                        "tests/reliability/test_faults.py",
                                        "tests/training/test_batch_ramp.py",  # the rates each step reads (decoupled too)
                                        "tests/training/test_batch_ramp_runtime.py",  # checkpoints at ramp changes
                                        "tests/training/test_overlap_param_gather.py",  # waits before save and eval
                                        # the trace's clock notes (offsets and error bounds per rank)
                                        "tests/core/test_clock.py::test_ranks_line_up_in_the_trace_despite_a_shifted_clock",
                                        SAFETY],
    "megatron_pp/training/arguments.py": ARGUMENT_TESTS,
    "megatron_pp/training/flags.py": ARGUMENT_TESTS,
    "megatron_pp/training/config_files.py": ARGUMENT_TESTS,
    "megatron_pp/training/job_schedule.py": ARGUMENT_TESTS,
    "megatron_pp/training/checkpointing.py": ["tests/training/test_checkpointing.py",
                                              "tests/training/test_2bw_resume.py",
                                              "tests/reliability/test_faults.py",
                                              "tests/reliability/test_bad_input.py",
                                              SAFETY],
    "megatron_pp/core/clock.py": ["tests/core/test_clock.py"],
    "megatron_pp/training/errors.py": ["tests/training/test_errors.py", "tests/reliability/test_failing_rank.py"],
    "megatron_pp/schedules/plugins.py": ["tests/schedules/test_plugins.py"],
    "megatron_pp/schedules/schedule_file.py": ["tests/schedules/test_schedule_file.py"],
    "megatron_pp/convert/megatron_lm.py": ["tests/tools/test_convert_checkpoint.py"],
    "megatron_pp/convert/torch_dist.py": ["tests/tools/test_convert_checkpoint.py", "tests/convert/test_megatron_core.py"],
    "megatron_pp/data/gpt_dataset.py": ["tests/data/test_gpt_dataset.py", "tests/data/test_blend.py"],
    "megatron_pp/data/blend.py": ["tests/data/test_blend.py"],
    # Modules changed since 9821f81 that the map did not name (issue 37): each with the tests that exercise it.
    "megatron_pp/benchmarks/__init__.py": ["tests/benchmarks/test_emulate.py"],
    "megatron_pp/benchmarks/emulate.py": ["tests/benchmarks/test_emulate_cost_model.py", "tests/benchmarks/test_emulate_timer.py",
                                          "tests/benchmarks/test_emulate.py", "tests/benchmarks/test_emulate_plan.py"],
    # The parent's side of the emulation (split out of emulate.py) and the full-size plans emulated.
    "megatron_pp/benchmarks/emulate_measure.py": ["tests/benchmarks/test_emulate_measure.py", "tests/benchmarks/test_emulate.py",
                                                  "tests/benchmarks/test_emulate_run.py"],
    "megatron_pp/benchmarks/emulate_plan.py": ["tests/benchmarks/test_emulate_plan.py"],
    # Its report is what tools/trace_vs_sim.py and the emulation table print.
    "megatron_pp/benchmarks/emulate_report.py": ["tests/benchmarks/test_emulate_run.py", "tests/benchmarks/test_emulate.py",
                                                 "tests/tools/test_trace_vs_sim.py"],
    # Its per-schedule summary runs under bench_schedules.py (bench_mfu.py's CPU run has no schedule rows).
    "megatron_pp/benchmarks/harness.py": ["tests/benchmarks/test_harness_device.py", "tests/benchmarks/test_bench_mfu.py",
                                          "tests/benchmarks/test_bench_schedules.py"],
    "megatron_pp/benchmarks/soak.py": ["tests/reliability/test_soak.py"],
    "megatron_pp/convert/__init__.py": ["tests/tools/test_convert_checkpoint.py", "tests/convert/test_megatron_core.py"],
    "megatron_pp/convert/core.py": ["tests/convert/test_megatron_core.py", "tests/models/test_megatron_core_model.py",
                                    "tests/tools/test_convert_checkpoint.py"],
    "megatron_pp/convert/export_args.py": ["tests/convert/test_export_args_layout.py", "tests/tools/test_convert_checkpoint.py",
                                           "tests/convert/test_megatron_core.py",
                                           "tests/convert/test_export_position.py"],  # the data position's fields
    "megatron_pp/convert/hf.py": ["tests/tools/test_convert_checkpoint.py", "tests/models/test_hf.py"],
    "megatron_pp/convert/megatron_pp.py": ["tests/convert/test_megatron_core.py", "tests/models/test_megatron_core_model.py",
                                           "tests/convert/test_export_position.py"],
    "megatron_pp/core/comm.py": ["tests/core/test_comm.py", "tests/core/test_p2p.py",
                                 "tests/schedules/test_exactness.py::test_exact_world2"],
    "megatron_pp/core/comm_check.py": ["tests/training/test_dry_run.py", "tests/planning/test_optimizer_step.py"],
    "megatron_pp/core/host_read.py": ["tests/core/test_storage.py", "tests/training/test_dry_run.py"],
    "megatron_pp/core/p2p.py": ["tests/core/test_p2p.py", "tests/schedules/test_exactness.py::test_exact_world2"],
    "megatron_pp/core/storage.py": ["tests/core/test_storage.py", "tests/schedules/test_offload_store.py"],
    "megatron_pp/core/tensor_parallel/utils.py": ["tests/core/test_tensor_parallel.py", "tests/models/test_tp_model.py"],
    "megatron_pp/data/builder.py": ["tests/data/test_builder.py", "tests/data/test_blend.py",
                                    "tests/data/test_megatron_order.py"],
    "megatron_pp/data/demo_corpus.py": ["tests/data/test_demo_corpus.py"],
    "megatron_pp/data/megatron_cache.py": ["tests/data/test_megatron_order.py"],
    "megatron_pp/data/megatron_order.py": ["tests/data/test_megatron_order.py"],
    "megatron_pp/data/preprocess.py": ["tests/data/test_preprocess_in_flight.py", "tests/data/test_tools.py"],
    "megatron_pp/data/tokenizers.py": ["tests/data/test_tokenizers.py", "tests/data/test_tools.py"],
    "megatron_pp/models/__init__.py": ["tests/models/test_config.py"],
    "megatron_pp/models/config.py": ["tests/models/test_config.py", "tests/training/test_arguments.py"],
    "megatron_pp/models/hf.py": ["tests/models/test_hf.py"],
    "megatron_pp/models/init.py": ["tests/models/test_init_skip_path.py", "tests/models/test_init.py",
                                   "tests/models/test_transformer.py"],
    "megatron_pp/models/layers.py": ["tests/models/test_transformer.py", "tests/models/test_fused_ops.py",
                                     "tests/models/test_attention.py", "tests/models/test_tp_model.py"],
    "megatron_pp/models/ops.py": ["tests/models/test_fused_ops.py", "tests/models/test_hf.py"],
    "megatron_pp/models/recompute.py": ["tests/models/test_recompute.py", "tests/models/test_fused_ops.py"],
    "megatron_pp/models/transformer.py": ["tests/models/test_transformer.py", "tests/models/test_tp_model.py",
                                          "tests/models/test_hf.py"],
    "megatron_pp/planning/bpipe_estimator.py": ["tests/planning/test_bpipe_estimator.py"],
    "megatron_pp/planning/cost.py": ["tests/planning/test_planner.py"],
    "megatron_pp/planning/job.py": ["tests/planning/test_planner.py", "tests/tools/test_plan.py"],
    "megatron_pp/planning/memory.py": ["tests/planning/test_memory.py", "tests/planning/test_planner.py",
                                       "tests/planning/test_backward_transient.py"],
    "megatron_pp/planning/papers/bpipe.py": ["tests/tools/test_reproduce.py"],
    "megatron_pp/planning/papers/layered.py": ["tests/planning/papers/test_layered.py"],
    "megatron_pp/planning/papers/small.py": ["tests/tools/test_reproduce.py"],
    "megatron_pp/planning/report.py": ["tests/planning/test_planner.py"],
    "megatron_pp/planning/stash_curve.py": ["tests/planning/test_planner.py", "tests/planning/test_optimizer_step.py"],
    "megatron_pp/planning/verify.py": ["tests/tools/test_plan_verify.py", "tests/tools/test_dry_run_table.py",
                                       "tests/planning/test_planner_vs_dry_run.py"],
    "megatron_pp/schedules/registry.py": ["tests/schedules/test_plugins.py", "tests/schedules/test_generators.py",
                                          "tests/tools/test_schedule_matrix.py"],
    "megatron_pp/schedules/runtime.py": ["tests/schedules/test_bpipe.py", "tests/schedules/test_bpipe_exec.py"],
    "megatron_pp/testing/__init__.py": ["tests/testing/test_interaction.py"],
    "megatron_pp/testing/interaction.py": ["tests/testing/test_interaction.py", "tests/training/test_interaction_matrix.py"],
    "megatron_pp/testing/matrix_plugin.py": ["tests/testing/test_interaction.py", "tests/training/test_interaction_matrix.py"],
    "megatron_pp/training/dry_run.py": ["tests/training/test_dry_run_tracker.py", "tests/training/test_dry_run.py"],
    "megatron_pp/training/dry_run_agree.py": ["tests/training/test_dry_run.py"],
    "megatron_pp/training/dry_run_bpipe.py": ["tests/schedules/test_bpipe_dry_run.py", "tests/training/test_dry_run.py"],
    "megatron_pp/training/megatron_compat.py": ["tests/training/test_megatron_lm_scripts.py",
                                                "tests/training/test_megatron_compat.py"],
    # The tied embedding at every placement: across ranks (interleaved) and both ends on rank 0 (zb-v,
    # v-half), where the head's copy must be the embedding's own parameter (test_grad_reduce.py's plan check).
    "megatron_pp/training/model.py": ["tests/core/test_grad_reduce.py", EDGES, "tests/training/test_pretrain.py"],
    "megatron_pp/training/offload_probe.py": ["tests/training/test_offload_probe.py"],
    "megatron_pp/training/pipeline.py": ["tests/training/test_pretrain.py", "tests/training/test_megatron_compat.py",
                                         "tests/training/test_batch_ramp.py",  # a ramp's executors (executor_for)
                                         "tests/training/test_dry_run.py", "tests/training/test_batch_ramp_runtime.py",
                                         "tests/training/test_overlap_param_gather.py"],
    "megatron_pp/training/weight_versions.py": ["tests/training/test_2bw.py", "tests/schedules/test_2bw.py"],
    "megatron_pp/training/batch_ramp.py": ["tests/training/test_batch_ramp.py"],
    # A dead rank, a dead store host, a rank stopped by another's reported error (whichever rank fails).
    "megatron_pp/training/watchdog.py": ["tests/reliability/test_watchdog.py", "tests/reliability/test_watchdog_verdict.py",
                                         "tests/reliability/test_failing_rank.py",
                                         "tests/reliability/test_faults.py", "tests/training/test_train.py"],
}

_FLIP = {ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"), ast.Gt: (">", ">="), ast.GtE: (">=", ">"),
         ast.Eq: ("==", "!="), ast.NotEq: ("!=", "==")}
_OP_TOKEN = re.compile(r"<=|>=|==|!=|<|>")


@dataclass(frozen=True)
class Mutant:
    path: str
    line: int
    col: int
    operator: str
    """cmp, int+1, int-1, and/or, drop."""
    start: int
    """Character span of the source that is replaced."""
    end: int
    replacement: str
    original: str
    """The line as written."""
    mutated: str
    """The same line with the mutant applied (its first line, when the span covers several)."""

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}:{self.col}:{self.operator}"


def _offsets(source: str) -> list[int]:
    starts, total = [], 0
    for line in source.splitlines(keepends=True):
        starts.append(total)
        total += len(line)
    return starts + [total]


def _skipped_nodes(tree: ast.AST) -> set[int]:
    """ids of nodes inside f-strings, annotations and docstrings, where a mutant is no bug or no code."""
    skipped: set[int] = set()

    def skip(node: Optional[ast.AST]) -> None:
        if node is not None:
            skipped.update(id(n) for n in ast.walk(node))

    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            skip(node)
        elif isinstance(node, (ast.AnnAssign, ast.arg)):
            skip(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            skip(node.returns)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                skip(first)
    return skipped


def mutants_of(path: str, source: str) -> list[Mutant]:
    """Every mutant of one module's source (`path` is how the report names it)."""
    tree = ast.parse(source)
    starts = _offsets(source)
    skipped = _skipped_nodes(tree)

    def pos(line: int, col: int) -> int:
        return starts[line - 1] + col

    out: list[Mutant] = []

    def add(node: ast.AST, operator: str, start: int, end: int, replacement: str) -> None:
        line = node.lineno
        rest = source.find("\n", end)
        mutated = source[starts[line - 1]:start] + replacement + source[end:len(source) if rest < 0 else rest]
        out.append(Mutant(path, line, node.col_offset, operator, start, end, replacement,
                          source[starts[line - 1]:starts[line]].rstrip("\n"), mutated.splitlines()[0]))

    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _FLIP:
            left_end = pos(node.left.end_lineno, node.left.end_col_offset)
            right_start = pos(node.comparators[0].lineno, node.comparators[0].col_offset)
            match = _OP_TOKEN.search(source, left_end, right_start)
            old, new = _FLIP[type(node.ops[0])]
            if match is not None and match.group() == old:
                add(node, "cmp", match.start(), match.end(), new)
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            span = (pos(node.lineno, node.col_offset), pos(node.end_lineno, node.end_col_offset))
            add(node, "int+1", *span, str(node.value + 1))
            add(node, "int-1", *span, f"({node.value - 1})" if node.value == 0 else str(node.value - 1))
        elif isinstance(node, ast.BoolOp):
            old, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
            a, b = node.values[0], node.values[1]
            match = re.compile(rf"\b{old}\b").search(source, pos(a.end_lineno, a.end_col_offset),
                                                      pos(b.lineno, b.col_offset))
            if match is not None:
                add(node, "and/or", match.start(), match.end(), new)
        elif isinstance(node, (ast.Expr, ast.Assign, ast.AugAssign)) and not (
                isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            add(node, "drop", pos(node.lineno, node.col_offset), pos(node.end_lineno, node.end_col_offset), "pass")
    out.sort(key=lambda m: (m.line, m.col, m.operator))
    return out


def apply(source: str, mutant: Mutant) -> str:
    return source[:mutant.start] + mutant.replacement + source[mutant.end:]


def all_mutants(root: str, modules: Sequence[str]) -> list[Mutant]:
    out = []
    for module in modules:
        with open(os.path.join(root, module)) as f:
            out += mutants_of(module, f.read())
    return out


_HUNK = re.compile(r"^@@ -\S+ \+(\d+)(?:,(\d+))? @@", re.MULTILINE)


def parse_changed_lines(diff: str) -> dict[str, set[int]]:
    """Per file (its path now), the line numbers a unified diff with no context (`-U0`) adds or rewrites.

    A hunk header `@@ -40,2 +41,3 @@` adds lines 41, 42, 43; `+41,0` only deletes (no line now); `+41`
    is one line. A deleted file has no lines now and is left out.
    """
    changed: dict[str, set[int]] = {}
    for block in re.split(r"^diff --git ", diff, flags=re.MULTILINE)[1:]:
        target = re.search(r"^\+\+\+ (?:b/)?(.+)$", block, re.MULTILINE)
        if target is None or target.group(1) == "/dev/null":
            continue
        lines = changed.setdefault(target.group(1), set())
        for match in _HUNK.finditer(block):
            start, count = int(match.group(1)), int(match.group(2) or 1)
            lines.update(range(start, start + count))
    return changed


def changed_lines(root: str, commit: str, upto: Optional[str] = None) -> dict[str, set[int]]:
    """`parse_changed_lines` of commit `upto` (default: the working tree) at `root` against `commit` (renames
    followed)."""
    proc = subprocess.run(["git", "diff", "-U0", "-M", "--no-color", commit, *([upto] if upto else []), "--", "."],
                          cwd=root, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ValueError(f"--since {commit}: {' '.join(proc.stderr.split()) or 'git diff failed'}")
    return parse_changed_lines(proc.stdout)


def on_changed_lines(mutants: Sequence[Mutant], changed: dict[str, set[int]]) -> list[Mutant]:
    """The mutants whose spot (their first line) is on a changed line of their module."""
    return [m for m in mutants if m.line in changed.get(m.path, ())]


def committed_tree(root: str, into: str, commit: str = "HEAD") -> tuple[str, str]:
    """(a directory holding `commit`'s tracked files, extracted from git, and the commit's hash). Others' edits
    in the working tree, committed or not while a run goes on, never reach it: each mutant is planted in
    committed code and the report's `at` is the tree that was measured."""
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{commit}^{{commit}}"], cwd=root, capture_output=True,
                         text=True)
    if sha.returncode != 0:
        raise ValueError(f"{commit}: {' '.join(sha.stderr.split()) or 'not a commit'}")
    sha_text = sha.stdout.strip()
    dest = os.path.join(into, "tree")
    os.makedirs(dest)
    archive = subprocess.run(["git", "archive", "--format=tar", sha_text], cwd=root, capture_output=True, check=True)
    import io
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest, sha_text


def _copy_tree(root: str, into: str) -> str:
    ignore = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.pyc", ".pytest_cache", "runs", "checkpoints")
    dest = os.path.join(into, "repo")
    shutil.copytree(root, dest, ignore=ignore)
    return dest


def _failed_test(output: str) -> Optional[str]:
    # "FAILED tests/x.py::test[param with spaces] - message": the node id ends at " - ".
    match = re.search(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", output, re.MULTILINE)
    return match.group(1) if match else None


def run_tests(repo: str, tests: Sequence[str], timeout: float) -> tuple[str, Optional[str], float]:
    """('passed' | 'failed' | 'timeout', the first failing test, seconds) for `tests` run in `repo`."""
    env = {**os.environ, "PYTHONPATH": repo, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "-p", "no:cacheprovider", *tests]
    start = time.monotonic()
    # A session of its own, so a time-out also ends the test's worker processes.
    proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return "timeout", None, time.monotonic() - start
    seconds = time.monotonic() - start
    if proc.returncode == 0:
        return "passed", None, seconds
    # Test failures, or an import/collection error the mutant caused: with a test named by node id, a module
    # that no longer imports leaves pytest nothing to collect, exit 4, with the error it hit beside it.
    if proc.returncode in (1, 2) or (proc.returncode == 4 and "ERROR collecting" in output):
        lines = output.strip().splitlines()
        return "failed", _failed_test(output) or (lines[-1] if lines else None), seconds
    raise RuntimeError(f"pytest exited {proc.returncode} on {' '.join(tests)}:\n{output[-2000:]}")


def check(root: str, mutants: Sequence[Mutant], timeout: float, log=print, on_result=None) -> list[dict]:
    """Run each mutant's covering tests in a private copy of `root`; one result dict per mutant.
    `on_result(results so far)` is called after each mutant (a long run's partial report)."""
    results = []
    with tempfile.TemporaryDirectory(prefix="mutation-") as scratch:
        repo = _copy_tree(root, scratch)
        for n, mutant in enumerate(mutants, 1):
            target = os.path.join(repo, mutant.path)
            with open(target) as f:
                original = f.read()
            mutated = apply(original, mutant)
            try:
                ast.parse(mutated)
            except SyntaxError:
                results.append({**_describe(mutant), "outcome": "invalid"})
                continue
            with open(target, "w") as f:
                f.write(mutated)
            try:
                outcome, test, seconds = run_tests(repo, COVERING[mutant.path], timeout)
            finally:
                with open(target, "w") as f:
                    f.write(original)
            results.append({**_describe(mutant), "outcome": "survived" if outcome == "passed" else outcome,
                            "killed_by_suite": test, "seconds": round(seconds, 1)})
            log(f"[{n}/{len(mutants)}] {mutant.id}: {results[-1]['outcome']} ({seconds:.0f} s)")
            if on_result is not None:
                on_result(results)
    return results


def _describe(mutant: Mutant) -> dict:
    return {"id": mutant.id, "where": f"{mutant.path}:{mutant.line}", "operator": mutant.operator,
            "original": mutant.original.strip(), "mutant": mutant.mutated.strip()}


def report(results: Sequence[dict], notes: dict, command: str) -> dict:
    """The JSON report: counts, and every survivor with its note (killed_by or equivalent)."""
    valid = [r for r in results if r["outcome"] != "invalid"]
    killed = [r for r in valid if r["outcome"] in ("failed", "timeout")]
    survivors = [{k: r[k] for k in ("id", "where", "operator", "original", "mutant")}
                 for r in valid if r["outcome"] == "survived"]
    summary = {
        "command": command,
        "total": len(valid),
        "killed": len(killed),
        # A hang is a bug the suite would show, so a time-out kills; counted apart because a loaded
        # machine can also run past the limit (re-check those with --only and a longer --timeout).
        "timeouts": sum(r["outcome"] == "timeout" for r in killed),
        "survivors": survivors,
        "killed_mutants": [{"id": r["id"], "by": r["killed_by_suite"] or r["outcome"]} for r in killed],
    }
    return annotate(summary, notes)


def annotate(summary: dict, notes: dict) -> dict:
    """`summary` (a report) with its survivors' notes replaced by `notes` and the counts redone."""
    survivors = []
    for s in summary["survivors"]:
        entry = {k: s[k] for k in ("id", "where", "operator", "original", "mutant")}
        note = notes.get(s["id"], {})
        if "killed_by" in note:
            entry["killed_by"] = note["killed_by"]
        elif "equivalent" in note:
            entry["equivalent"] = note["equivalent"]
        elif "fixed" in note:
            # It led to a bug that was fixed: still a survivor (neither killed nor equivalent).
            entry["fixed"] = note["fixed"]
        elif "open" in note:
            # Understood, not equivalent, and not killed yet (e.g. code only a GPU runs): an open survivor.
            entry["open"] = note["open"]
        else:
            entry["unexplained"] = True
        survivors.append(entry)
    equivalent = sum(1 for s in survivors if "equivalent" in s)
    return {**summary, "equivalent": equivalent, "non_equivalent": summary["total"] - equivalent,
            "survivors": survivors}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = ExitingArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modules", nargs="*", default=None, help="Modules to mutate (default: all of COVERING).")
    parser.add_argument("--sample", type=int, default=None, metavar="N", help="Run N mutants drawn at random.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of --sample's draw.")
    parser.add_argument("--only", nargs="*", default=None, metavar="ID", help="Run just these mutant ids.")
    parser.add_argument("--timeout", type=float, default=600.0, help="Seconds per mutant before it counts as killed.")
    parser.add_argument("--notes", default=None, metavar="FILE",
                        help="JSON: mutant id -> {killed_by: test}, {equivalent: why} or {fixed: what}, for the "
                             "survivors.")
    parser.add_argument("--out", default=None, metavar="FILE", help="Write the JSON report here.")
    parser.add_argument("--list", action="store_true", help="Print the number of mutants per module and stop.")
    parser.add_argument("--since", default=None, metavar="COMMIT",
                        help="Plant mutants only on lines changed since COMMIT (git diff -U0 -M COMMIT).")
    parser.add_argument("--worktree", action="store_true",
                        help="Mutate the working tree as it is, uncommitted edits included (default: the committed "
                             "HEAD, extracted when the run starts).")
    parser.add_argument("--annotate", default=None, metavar="REPORT",
                        help="Run nothing: apply --notes to the survivors of REPORT and rewrite it.")
    args = parser.parse_args(argv)
    modules = args.modules if args.modules is not None else sorted(COVERING)
    unknown = [m for m in modules if m not in COVERING]
    if unknown:
        parser.error(f"--modules {unknown[0]}: no covering tests known; one of {', '.join(sorted(COVERING))}")
    if args.sample is not None and args.sample < 1:
        parser.error(f"--sample must be >= 1, got {args.sample}")
    notes = {}
    if args.notes is not None:
        try:
            with open(args.notes) as f:
                notes = json.load(f)
        except (OSError, ValueError) as exc:
            parser.error(f"--notes {args.notes}: {exc}")
    if args.annotate is not None:
        try:
            with open(args.annotate) as f:
                summary = annotate(json.load(f), notes)
        except (OSError, ValueError, KeyError) as exc:
            parser.error(f"--annotate {args.annotate}: {exc!r}")
        write_json(args.annotate, summary)
        return 0
    with tempfile.TemporaryDirectory(prefix="mutation-head-") as scratch:
        if args.worktree:
            return _run(args, parser, notes, modules, argv, ROOT, None)
        try:
            tree, head = committed_tree(ROOT, scratch)
        except (ValueError, subprocess.CalledProcessError) as exc:
            parser.error(f"the committed tree (use --worktree outside a git checkout): {exc}")
        return _run(args, parser, notes, modules, argv, tree, head)


def _run(args, parser, notes: dict, modules: Sequence[str], argv, tree: str, head: Optional[str]) -> int:
    """main's run, list or draw over the modules of `tree` (the committed HEAD `head`, or the working tree)."""
    mutants = all_mutants(tree, modules)
    unmapped: list[str] = []
    if args.since is not None:
        try:
            changed = changed_lines(ROOT, args.since, head)
        except ValueError as exc:
            parser.error(str(exc))
        mutants = on_changed_lines(mutants, changed)
        unmapped = sorted(p for p, lines in changed.items()
                          if lines and p.startswith("megatron_pp/") and p.endswith(".py") and p not in COVERING)
    if args.list:
        for module in modules:
            print(f"{sum(1 for m in mutants if m.path == module):5d}  {module}")
        print(f"{len(mutants):5d}  total")
        if unmapped:
            print(f"changed since {args.since} with no covering tests in the map: {', '.join(unmapped)}")
        return 0
    # What a sample is drawn from (the numbers `--list` prints), kept in the report.
    population = {"population": {"mutants": len(mutants), "modules": len({m.path for m in mutants})}}
    if args.only is not None:
        by_id = {m.id: m for m in mutants}
        missing = [i for i in args.only if i not in by_id]
        if missing:
            parser.error(f"--only {missing[0]}: no such mutant (see --list and the report's ids)")
        mutants = [by_id[i] for i in args.only]
    elif args.sample is not None:
        mutants = sorted(random.Random(args.seed).sample(mutants, min(args.sample, len(mutants))),
                         key=lambda m: (m.path, m.line, m.col, m.operator))
    command = "python dev/mutation_check.py " + " ".join(argv if argv is not None else sys.argv[1:])
    # What was mutated: a partial report (a run stopped early) says it as the whole one does.
    since = population if args.since is None else {**population, "since": args.since, "at": head or "working tree",
                                                    "changed_unmapped": unmapped}

    def partial(results: list[dict]) -> None:
        # Written after every mutant, so a run stopped early still leaves what it measured (marked partial).
        if args.out and len(results) < len(mutants):
            write_json(args.out, {**report(results, notes, command), **since,
                                  "partial": f"{len(results)} of {len(mutants)}"})

    results = check(tree, mutants, args.timeout, on_result=partial)
    summary = {**report(results, notes, command), **since}
    print(f"{summary['killed']} of {summary['non_equivalent']} non-equivalent mutants killed "
          f"({summary['equivalent']} equivalent, {len(summary['survivors'])} survived)")
    if args.out:
        write_json(args.out, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
