"""The run's configuration (angpt.config): the parser built from the sections, the frozen sections validation
returns, megatron-core's configs filled by field name, and the one reader of a checkpoint's recorded flags."""

import dataclasses
import logging

import pytest
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer.enums import AttnBackend

from angpt.config.arguments import parse_args
from angpt.config.parser import flag_actions
from angpt.config.saved import config_from_saved, single_process
from angpt.config.sections import FIELD_SECTIONS, SECTIONS, RunConfig
from angpt.config.validation import derive
from angpt.models import AnGPTConfig
from angpt.training import checkpointing, faults, megatron_configs
from angpt.training.megatron_configs import by_name, ddp_config, transformer_config
from angpt.training.optimizer import optimizer_config

from conftest import in_process_trainer

MOCK = ["--mock-data", "--vocab-size", "256", "--train-iters", "10"]


def flag_fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for section in SECTIONS.values() for f in dataclasses.fields(section) if "flag" in f.metadata}


def test_every_flag_is_a_field_with_its_default_and_every_field_a_flag():
    actions = {dest: action for dest, action in flag_actions().items() if not dest.startswith("megatron_")}
    fields = flag_fields()
    assert set(actions) == set(fields)
    for name, field in fields.items():
        default = list(field.default) if isinstance(field.default, tuple) else field.default
        assert actions[name].default == default, name


def test_the_configuration_is_frozen_and_its_flags_round_trip():
    config = parse_args([*MOCK, "--tensor-model-parallel-size", "2", "--cp-comm-type", "all_gather"], world_size=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.training.train_iters = 3
    assert RunConfig.from_flags(config.flags()) == config
    assert config.flags()["cp_comm_type"] == ["all_gather"]  # as argparse gives it, and checkpoints record it


def test_validation_derives_the_layout_and_the_length_of_training_once():
    config = parse_args(["--mock-data", "--vocab-size", "256", "--train-samples", "100", "--global-batch-size", "8",
                         "--tensor-model-parallel-size", "2", "--sequence-parallel", "--micro-batch-size", "1"],
                        world_size=8)
    # 100 samples are 12 whole global batches of 8; the 4 left over are left out, as in Megatron-LM.
    assert config.training.train_iters == 12
    assert (config.parallel.world_size, config.parallel.data_parallel_size) == (8, 4)
    assert config.parallel.sequence_parallel and not config.parallel.sequence_parallel_disabled
    alone = parse_args([*MOCK, "--sequence-parallel"], world_size=1)
    assert not alone.parallel.sequence_parallel and alone.parallel.sequence_parallel_disabled


def test_flag_errors_name_the_flag_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--train-iters", "0", "--mock-data", "--vocab-size", "256"], world_size=1)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "angpt.pretrain: error: --train-iters 0 must be at least 1 (see --help)"]


# A value for each field that a section shares by name with megatron-core's model config, other than both defaults.
TRANSFORMER_VALUES = dict(
    perform_initialization=False,
    account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True, apply_rope_fusion=True,
    attention_dropout=0.25, bf16=True, calculate_per_token_loss=True, context_parallel_size=2,
    config_logger_dir="configs", cross_entropy_fusion_impl="te", cross_entropy_loss_fusion=True,
    cuda_graph_warmup_steps=5, deterministic_mode=True,
    defer_embedding_wgrad_compute=True, wgrad_deferral_limit=3, disable_bf16_reduced_precision_matmul=True,
    ffn_hidden_size=96, first_last_layers_bf16=True, fp16=True, fp8_amax_compute_algo="max", fp8_amax_history_len=16,
    fp8_margin=1, fp8_recipe="tensorwise",
    expert_tensor_parallel_size=4, hidden_dropout=0.25, hidden_size=64, hierarchical_context_parallel_sizes=[2, 2],
    init_method_std=0.01,
    kv_channels=8, model_family="gptplus",
    microbatch_group_size_per_vp_stage=4, min_offloaded_tensor_size=7,
    num_attention_heads=8, num_layers=6, num_layers_at_end_in_bf16=2,
    num_layers_at_start_in_bf16=0, num_query_groups=2,
    pipeline_model_parallel_layout="Et|ttt|ttL",
    pipeline_model_parallel_size=3, recompute_granularity="selective", rotary_base=500000, sequence_parallel=True,
    tensor_model_parallel_size=2, test_mode=True, transformer_impl="transformer_engine",
    distribute_saved_activations=True, fp32_residual_connection=True, fp8_wgrad=False,
    clone_scatter_output_in_embedding=False, cuda_graph_scope=["full_iteration"], batch_invariant_mode=True,
)
# The architecture fields shared by name: --model-family gpt's (the other families fix their own architecture).
ARCHITECTURE_VALUES = dict(
    add_bias_linear=False, add_qkv_bias=True, apply_query_key_layer_scaling=True, attention_softmax_in_fp32=True,
    layernorm_zero_centered_gamma=True, max_position_embeddings=256, normalization="RMSNorm",
    position_embedding_type="none", qk_l2_norm=True, qk_layernorm=True, rotary_interleaved=True, rotary_percent=0.5,
    use_rope_scaling=True, embedding_init_method_std=0.5, glu_linear_offset=0.5, activation_func_clamp_value=7.0,
    no_rope_freq=[0, 1], mtp_num_layers=2, mtp_loss_scaling_factor=0.5, mtp_standalone=True,
)
# Fields shared by name that are set otherwise, each for a reason named in angpt.training.megatron_configs.
TRANSFORMER_OVERRIDDEN = {
    "cp_comm_type": "one value for all layers (megatron-core reads a list per layer)",
    "attention_backend": "megatron-core's AttnBackend, from its name",
    "recompute_method": "full recompute only", "recompute_num_layers": "full recompute only",
    "recompute_modules": "selective recompute only",
    "cuda_graph_impl": "needs a CUDA device (refused on the CPU)",
    "overlap_p2p_comm": "the interleaved schedule only (Megatron-LM's rule), and not without CUDA",
    "overlap_p2p_comm_warmup_flush": "not without CUDA (the exchanges are not overlapped there)",
    # tests/test_activation_offloading.py
    "cpu_offloading_num_layers": "needs a CUDA device (refused on the CPU)",
    "fine_grained_activation_offloading": "needs a CUDA device (refused on the CPU)",
    "offload_modules": "megatron-core's list, [] when not given",
}


def model_config_fields(config: RunConfig, monkeypatch) -> dict:
    """The fields transformer_config hands to angpt.models.model_config (which megatron-core then checks, some
    only with Transformer Engine or a GPU)."""
    monkeypatch.setattr(megatron_configs, "model_config", lambda family, **fields: dict(fields, model_family=family))
    return transformer_config(config)


def test_every_flag_that_is_a_field_of_the_model_config_lands_there(monkeypatch):
    shared = set(by_name(RunConfig(), AnGPTConfig))
    assert shared == set(TRANSFORMER_VALUES) | set(ARCHITECTURE_VALUES) | set(TRANSFORMER_OVERRIDDEN)
    for name, value in TRANSFORMER_VALUES.items():
        config = RunConfig().replace(**{FIELD_SECTIONS[name]: {name: value}})
        assert model_config_fields(config, monkeypatch)[name] == value, name
    for name, value in ARCHITECTURE_VALUES.items():
        config = RunConfig().replace(**{FIELD_SECTIONS[name]: {name: value}})
        assert name not in model_config_fields(config, monkeypatch), name  # anGPT's own
        gpt = config.replace(model=dict(model_family="gpt"))
        assert model_config_fields(gpt, monkeypatch)[name] == value, name
    # The flags named otherwise than their fields, and the overridden ones.
    flags = dict(fp8_format="e4m3", norm_epsilon=1e-6, decoder_first_pipeline_num_layers=3,
                 decoder_last_pipeline_num_layers=2, tie_embeddings_and_output_weights=True, reset_position_ids=True,
                 cp_comm_type=("a2a",), attention_backend="flash", recompute_granularity="full",
                 recompute_method="block", recompute_num_layers=2, angpt_nu_alpha_multiplier=2.0,
                 angpt_residual="plain", angpt_no_nu_alpha_grad=True, bias_swiglu_fusion=True)
    fields = model_config_fields(RunConfig.from_flags(flags).replace(parallel=dict(virtual_pipeline_stages=2)),
                                 monkeypatch)
    assert {name: fields[name] for name in (
        "fp8", "layernorm_epsilon", "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
        "share_embeddings_and_output_weights", "rope_position_ids", "cp_comm_type", "attention_backend",
        "recompute_method", "recompute_num_layers", "recompute_modules", "nu_alpha_multiplier", "residual",
        "nu_alpha_grad", "bias_activation_fusion", "virtual_pipeline_model_parallel_size")} == dict(
        fp8="e4m3", layernorm_epsilon=1e-6, num_layers_in_first_pipeline_stage=3, num_layers_in_last_pipeline_stage=2,
        share_embeddings_and_output_weights=True, rope_position_ids=True, cp_comm_type="a2a",
        attention_backend=AttnBackend.flash, recompute_method="block", recompute_num_layers=2,
        recompute_modules=None, nu_alpha_multiplier=2.0, residual="plain", nu_alpha_grad=False,
        bias_activation_fusion=True, virtual_pipeline_model_parallel_size=2)
    selective = model_config_fields(RunConfig.from_flags(dict(recompute_granularity="selective",
                                                              recompute_modules=("mlp",))), monkeypatch)
    assert (selective["recompute_method"], selective["recompute_num_layers"], selective["recompute_modules"]) == (
        None, None, ["mlp"])
    # nGPT fixes its own factors: the switches that set them do not reach its config.
    assert "constant_factors" not in model_config_fields(RunConfig.from_flags(dict(model_family="ngpt")), monkeypatch)


DDP_VALUES = dict(average_in_collective=True, check_for_large_grads=True, overlap_grad_reduce=True,
                  num_distributed_optimizer_instances=2, overlap_param_gather=True,
                  use_distributed_optimizer=True, use_megatron_fsdp=True, data_parallel_sharding_strategy="optim",
                  gradient_reduce_div_fusion=False, pad_buckets_for_high_nccl_busbw=True,
                  reduce_scatter_with_fp32_accumulation=True, align_param_gather=False)
OPTIMIZER_VALUES = dict(adam_beta1=0.8, adam_beta2=0.99, adam_eps=1e-6, apply_wd_to_qk_layernorm=True, bf16=True,
                        clip_grad=0.5, config_logger_dir="configs", decoupled_lr=1e-4,
                        decoupled_min_lr=1e-5, fp16=True, fp8_recipe="mxfp8", hysteresis=4, initial_loss_scale=1024.0,
                        loss_scale=128.0, loss_scale_window=50, lr=0.02, min_loss_scale=2.0, min_lr=1e-3,
                        overlap_param_gather=True, overlap_param_gather_with_optimizer_step=True,
                        use_distributed_optimizer=True, weight_decay=0.05)


def test_every_flag_that_is_a_field_of_the_ddp_and_optimizer_configs_lands_there():
    assert set(by_name(RunConfig(), DistributedDataParallelConfig)) == set(DDP_VALUES)
    ddp = ddp_config(RunConfig.from_flags({**DDP_VALUES, "grad_reduce_in_bf16": True, "ddp_bucket_size": 1000}))
    assert {name: getattr(ddp, name) for name in DDP_VALUES} == DDP_VALUES
    assert (ddp.grad_reduce_in_fp32, ddp.bucket_size) == (False, 1000)
    # --log-num-zeros-in-grad is counted by the monitor at the logged steps (named in optimizer_config).
    assert set(by_name(RunConfig(), OptimizerConfig)) == set(OPTIMIZER_VALUES) | {"log_num_zeros_in_grad"}
    optimizer = optimizer_config(RunConfig.from_flags({**OPTIMIZER_VALUES, "log_num_zeros_in_grad": True}))
    assert {name: getattr(optimizer, name) for name in OPTIMIZER_VALUES} == OPTIMIZER_VALUES
    assert not optimizer.log_num_zeros_in_grad


@pytest.mark.parametrize("family, min_lr, weight_decay", [("angpt", 1e-3, 0.0), ("ngpt", 0.0, 0.0),
                                                           ("gptplus", 1e-3, 0.1)])
def test_an_unset_min_lr_and_weight_decay_are_the_familys_recipe(family, min_lr, weight_decay):
    # docs/model.md, Optimizer and schedule: cosine to 0.1 lr (nGPT: to 0); weight decay 0.1 for GPT+ only.
    config = optimizer_config(RunConfig.from_flags(dict(model_family=family, lr=1e-2)))
    assert (config.min_lr, config.weight_decay) == (pytest.approx(min_lr), weight_decay)


def test_an_old_checkpoints_flags_read_with_todays_defaults():
    """Flags recorded before --context-parallel-size, --norm-epsilon and the dropouts existed, one since removed."""
    recorded = {"model_family": "ngpt", "num_layers": 3, "hidden_size": 64, "num_attention_heads": 4,
                "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1, "world_size": 4,
                "train_iters": 7, "bf16": True, "a_flag_since_removed": 1}
    config = config_from_saved(recorded)
    assert (config.model.model_family, config.model.num_layers, config.training.train_iters) == ("ngpt", 3, 7)
    assert (config.parallel.context_parallel_size, config.parallel.cp_comm_type, config.model.norm_epsilon,
            config.model.attention_dropout) == (1, ("p2p",), 1e-5, 0.0)
    assert config.parallel.data_parallel_size == 2  # derived again: 4 processes over TP 2
    one = single_process(config)
    assert (one.parallel.tensor_model_parallel_size, one.precision.bf16, one.model.num_layers) == (1, False, 3)
    model = transformer_config(one)
    assert (model.num_layers, model.hidden_size, model.tensor_model_parallel_size) == (3, 64, 1)
    with pytest.raises(ValueError, match="no model family"):
        config_from_saved({"num_layers": 3})


def test_derive_recomputes_what_validation_derived():
    config = parse_args([*MOCK, "--recompute-activations", "--save", "x", "--exit-signal-handler", "--exit-signal",
                         "SIGUSR1", "--tensor-model-parallel-size", "2"], world_size=2)
    flags = config.flags()
    assert RunConfig.from_flags({**flags, **derive(flags, 2)}) == config
    assert config.model.recompute_granularity == "selective"
    assert config.exits.save_and_exit_signals == ("SIGTERM", "SIGUSR1")
    assert parse_args(MOCK, world_size=1).exits.save_and_exit_signals == ()  # nowhere to save


def test_production_runs_without_fault_hooks(monkeypatch):
    for name in faults.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert faults.from_environment() is faults.NO_HOOKS
    monkeypatch.setenv(faults.STEP_SECONDS, "0.5")
    assert faults.from_environment().step_seconds == 0.5


@pytest.mark.slow  # in-process trainer builds, seconds each: out of make test-fast
def test_a_resume_with_another_model_shape_is_refused_naming_the_flags(tmp_path, single_process, caplog):
    model = ["--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
             "--global-batch-size", "2", "--mock-data", "--vocab-size", "128", "--eval-iters", "0"]
    assert in_process_trainer([*model, "--num-layers", "2", "--train-iters", "1", "--save", str(tmp_path)]).run() == 0
    with pytest.raises(checkpointing.CheckpointError) as error:
        in_process_trainer([*model, "--num-layers", "3", "--train-iters", "2", "--load", str(tmp_path)])
    assert str(error.value) == (f"{tmp_path}/iter_0000001 holds a model of another shape: --num-layers 2 (this run: "
                                "3); give the flags it was saved with (or --load another directory)")
    with caplog.at_level(logging.INFO, logger="angpt"):  # the same shape resumes
        trainer = in_process_trainer([*model, "--num-layers", "2", "--train-iters", "2", "--load", str(tmp_path)])
    assert trainer.state.iteration == 1 and "loaded checkpoint" in caplog.text


@pytest.mark.slow  # six in-process trainer builds
@pytest.mark.parametrize("ckpt_format", ["torch_dist", "torch"])
def test_a_resume_with_other_factors_positions_or_vocabulary_is_refused_in_one_line(ckpt_format, tmp_path,
                                                                                      single_process):
    """Megatron-LM's check_checkpoint_args compares the position handling and the padded vocabulary before it
    reads a tensor; here the factors' switches and the optimizer's kind too (--no-load-optim loads the weights).
    --finetune may change the function, never the shapes. The vocabulary at its boundary: 129 ids pad to 256 rows,
    128 to the saved 128."""
    model = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
             "--micro-batch-size", "2", "--global-batch-size", "2", "--mock-data", "--eval-iters", "0",
             "--ckpt-format", ckpt_format]
    assert in_process_trainer([*model, "--vocab-size", "128", "--train-iters", "1", "--save", str(tmp_path)]).run() == 0
    path = f"{tmp_path}/iter_0000001"
    resume = [*model, "--train-iters", "2", "--load", str(tmp_path)]
    for flags, message in (
            (["--vocab-size", "128", "--angpt-residual", "plain", "--rotary-base", "500000"],
             f"{path} was trained with other model flags: --rotary-base 10000 (this run: 500000), --angpt-residual "
             "lerp (this run: plain); give the flags it was saved with to resume it, or --finetune from it"),
            (["--vocab-size", "129"], f"{path} holds an embedding of 128 rows, and this run's vocabulary of 129 ids "
                                      "pads to 256 (--make-vocab-size-divisible-by 128 x --tensor-model-parallel-size "
                                      "1): give the tokenizer (or --vocab-size) and padding it was saved with"),
            (["--vocab-size", "128", "--use-distributed-optimizer"],
             f"{path} was saved without the distributed optimizer and this run is with the distributed optimizer: its "
             "optimizer state does not convert (Megatron-LM's neither); give --no-load-optim to load the model alone, "
             "or no --use-distributed-optimizer")):
        with pytest.raises(checkpointing.CheckpointError) as error:
            in_process_trainer([*resume, *flags])
        assert str(error.value) == message
    assert in_process_trainer([*resume, "--vocab-size", "100"]).state.iteration == 1  # 100 ids pad to 128 too
    weights_alone = ["--vocab-size", "128", "--use-distributed-optimizer", "--no-load-optim"]
    assert in_process_trainer([*resume, *weights_alone]).state.iteration == 1
    finetuned = in_process_trainer([*resume, "--vocab-size", "128", "--rotary-base", "500000", "--finetune"])
    assert finetuned.state.iteration == 0
