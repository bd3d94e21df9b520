"""`OptimizerConfig`'s own checks (megatron_pp/training/optimizer.py), the ones tests/training/test_optimizer.py's
table leaves out: a library caller that builds the config without the argument parser gets the same one line
naming the flag. Issue 37's seed-45 mutation survivor dropped the `--grad-reduce-in-bf16` without `--bf16` check,
which no test asked for (the command line refuses it earlier, in training/arguments.py)."""
import pytest

from megatron_pp.training.optimizer import OptimizerConfig


@pytest.mark.parametrize("kwargs, line", [
    (dict(grad_reduce_in_bf16=True), "--grad-reduce-in-bf16 applies only to --bf16"),
    (dict(grad_reduce_in_bf16=True, fp16=True), "--grad-reduce-in-bf16 applies only to --bf16"),
    (dict(adam_eps=0.0), "--adam-eps must be > 0, got 0.0"),
    (dict(adam_beta1=-0.1), "--adam-beta1 must be in [0, 1), got -0.1"),
    (dict(lr=-1e-3), "--lr must be >= 0, got -0.001"),
    (dict(weight_decay=-0.1), "--weight-decay must be >= 0, got -0.1"),
    (dict(loss_scale_window=0), "--loss-scale-window must be >= 1, got 0"),
    (dict(data_parallel_sharding_strategy="zero2"), "--data-parallel-sharding-strategy 'zero2' is not one of"),
    (dict(data_parallel_sharding_strategy="optim"), "it needs --use-distributed-optimizer"),
    (dict(adam_implementation="apex"), "AdamW implementation 'apex' is not one of fused, foreach"),
])
def test_a_bad_setting_is_one_line_naming_its_flag(kwargs, line):
    with pytest.raises(ValueError) as info:
        OptimizerConfig(**kwargs)
    assert line in str(info.value) and ";" not in str(info.value)  # that problem alone


def test_the_settings_each_check_guards_are_accepted_when_right():
    OptimizerConfig(bf16=True, grad_reduce_in_bf16=True)
    OptimizerConfig(use_distributed_optimizer=True, data_parallel_sharding_strategy="optim_grads_params",
                    adam_implementation="foreach", adam_beta1=0.0, lr=0.0, weight_decay=0.0)
