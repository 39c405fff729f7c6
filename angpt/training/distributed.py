"""Process groups and seeds, as Megatron-LM sets them up: NCCL on GPUs, gloo on CPU."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import random
import socket
from datetime import timedelta
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.multi_token_prediction import get_mtp_ranks
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from angpt.megatron_compat import patches

logger = logging.getLogger("angpt.distributed")


# The all-reduce algorithms Megatron-LM's --deterministic-mode accepts in NCCL_ALGO (megatron/training/arguments.py).
DETERMINISTIC_NCCL_ALGOS = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS")


def use_deterministic_algorithms(transformer_engine: bool = False) -> None:
    """--deterministic-mode as Megatron-LM sets it up: torch's deterministic algorithms, and with CUDA an NCCL_ALGO
    of a deterministic all-reduce (before any communicator reads it). What torch and Transformer Engine need besides
    is set when the environment leaves it unset: cuBLAS's fixed workspace (CUBLAS_WORKSPACE_CONFIG, without which
    torch refuses a deterministic GEMM) and NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 (megatron-core refuses TE's attention
    without it); one given otherwise is refused in one line."""
    if torch.cuda.is_available():
        algorithm = os.environ.get("NCCL_ALGO")
        if algorithm not in DETERMINISTIC_NCCL_ALGOS:
            raise ValueError(f"--deterministic-mode needs NCCL_ALGO set to one of "
                             f"{', '.join(DETERMINISTIC_NCCL_ALGOS)} (a deterministic all-reduce, as Megatron-LM "
                             f"requires); it is {algorithm or 'not set'}")
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if transformer_engine and os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0") != "0":
            raise ValueError("--deterministic-mode with Transformer Engine needs NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 "
                             f"(it is {os.environ['NVTE_ALLOW_NONDETERMINISTIC_ALGO']})")
    torch.use_deterministic_algorithms(True)


def enable_batch_invariant_mode() -> None:
    """--batch-invariant-mode as Megatron-LM's initialize_megatron sets it up: megatron-core's Triton kernels
    registered for aten's mm, addmm, _log_softmax and mean.dim on the CUDA device, for the whole process."""
    if not torch.cuda.is_available():
        raise ValueError("--batch-invariant-mode: megatron-core's batch-invariant kernels are Triton's and need "
                         "CUDA; there is none here")
    from megatron.core.transformer.custom_layers.batch_invariant_kernels import (  # noqa: PLC0415 (imports Triton,
        enable_batch_invariant_mode,  # an optional dependency that CUDA machines have)
    )

    enable_batch_invariant_mode()


def initialize(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    seed: int = 1234,
    timeout_minutes: float = 10,
    cuda_graphs: bool = False,
    context_parallel_size: int = 1,
    flight_recorder_dump_path: Optional[str] = None,
    flight_recorder_trace_buffer_size: int = 2000,
    use_tp_pp_dp_mapping: bool = False,
    create_gloo_process_groups: bool = True,
    hierarchical_context_parallel_sizes: Optional[list[int]] = None,
    expert_tensor_parallel_size: Optional[int] = None,
    num_distributed_optimizer_instances: int = 1,
    create_all_gather_group: bool = False,
    fake_process_group: bool = False,
    get_embedding_ranks: Optional[Callable[[list[int]], list[int]]] = None,
) -> None:
    """Join the torchrun job (if not already joined), build megatron-core's groups and seed every RNG
    (`set_random_seed`). The ranks' order is Megatron-LM's: tp-cp-ep-dp-pp, or tp-cp-ep-pp-dp with
    --use-tp-pp-dp-mapping. Without `create_gloo_process_groups` (--disable-gloo-process-groups), megatron-core
    builds no gloo groups beside its others; with `create_all_gather_group` (--create-all-gather-group) it builds a
    second data-parallel (x context-parallel) group, for Megatron-FSDP's weight all-gathers. With
    `fake_process_group` (--fake-process-group) the process joins no job: it is rank $RANK of $WORLD_SIZE in torch's
    fake process group, whose collectives do nothing (as Megatron-LM's initialize). `get_embedding_ranks`: the
    ranks of a pipeline group whose copies of the word embedding are kept equal (`embedding_ranks`; megatron-core's
    default: the first and last)."""
    patches.install()  # megatron-core workarounds (the CPU adapter among them), before anything is built
    if flight_recorder_dump_path and not torch.cuda.is_available():
        raise ValueError("--flight-recorder-dump-path: NCCL's flight recorder records NCCL's collectives, which "
                         "run on CUDA only; on CPU use --hang-timeout-minutes")
    if not dist.is_initialized():
        if fake_process_group:  # as Megatron-LM: rank $RANK of $WORLD_SIZE (0 of 1 where unset), alone
            for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
                os.environ.setdefault(name, value)
        _default_to_one_process()
        flight_recorder_environment(flight_recorder_dump_path, flight_recorder_trace_buffer_size)
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        timeout = timedelta(minutes=timeout_minutes)
        store = FakeStore() if fake_process_group else _attempt_store(timeout)
        joined = {} if store is None else dict(store=store, rank=int(os.environ["RANK"]),
                                                world_size=int(os.environ["WORLD_SIZE"]))
        backend = "fake" if fake_process_group else "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=timeout, **joined)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        distributed_timeout_minutes=timeout_minutes,  # megatron-core's groups default to 30 minutes
        order="tp-cp-ep-pp-dp" if use_tp_pp_dp_mapping else "tp-cp-ep-dp-pp",
        create_gloo_process_groups=create_gloo_process_groups,
        hierarchical_context_parallel_sizes=hierarchical_context_parallel_sizes,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        num_distributed_optimizer_instances=num_distributed_optimizer_instances,
        create_all_gather_group=create_all_gather_group,
        get_embedding_ranks=get_embedding_ranks,
    )
    # megatron-core 0.16.1 builds its expert data-parallel gloo groups without that timeout (torch's 30 minutes):
    # idle in a dense model, but held to the flag like every other group.
    for group in (parallel_state._EXPERT_DATA_PARALLEL_GROUP_GLOO,
                  parallel_state._INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO):
        if group is not None:
            dist.distributed_c10d._set_pg_timeout(timedelta(minutes=timeout_minutes), group)
    set_random_seed(seed, cuda_graphs)


def embedding_ranks(pp_ranks: list[int], config) -> list[int]:
    """Megatron-LM's get_embedding_ranks (pretrain_gpt.py), for the model `config`: of a pipeline group's ranks, those
    holding a copy of the word embedding, whose gradients megatron-core all-reduces over them (and whose initial
    values it copies from the first): the first stage's, the last's where the output layer is tied to it, and each
    stage's with MTP layers, which embed the tokens ahead (megatron-core's get_mtp_ranks: a
    --pipeline-model-parallel-layout may put them on a stage before the last)."""
    ranks = [pp_ranks[0]]
    if len(pp_ranks) > 1:
        if config.share_embeddings_and_output_weights:
            ranks.append(pp_ranks[-1])
        ranks.extend(get_mtp_ranks(pp_ranks, config))
    return sorted(set(ranks))


def destroy_model_parallel() -> None:
    """megatron-core's destroy_model_parallel, and the process groups it built: it only forgets them, and each
    gloo group keeps its threads and sockets, so a process that set up the groups again and again (a test
    worker running layout after layout) held thousands of gloo threads and spent most of its time in the
    kernel (the equivalence job: 7.8 minutes, then 1.6)."""
    gc.collect()  # models already dropped hold their groups in reference cycles: freed with them now
    built, holders = {}, []
    for name, value in vars(parallel_state).items():
        for group in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(group, dist.ProcessGroup) and group is not dist.group.WORLD:
                built[id(group)] = group
                holders.append(name)
    parallel_state.destroy_model_parallel()
    for name in holders:  # the few it does not forget (_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP, 0.16.1)
        setattr(parallel_state, name, None)
    for group in built.values():
        with contextlib.suppress(ValueError):  # one torch no longer knows (destroyed with another name)
            dist.destroy_process_group(group)
    # torch caches DTensor sharding by device mesh, and a mesh over the groups built next equals one over these
    # (same ranks, same device): FSDP2 built again would shard over the destroyed groups ("Could not resolve the
    # process group").
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", lambda: None)()


def flight_recorder_environment(dump_path: Optional[str], trace_buffer_size: int) -> None:
    """Megatron-LM's --flight-recorder-* (its main after core_v0.16.1, megatron/training/initialize.py), before the
    process group is created: with a dump path, or one already in TORCH_FR_DUMP_TEMP_FILE or
    TORCH_NCCL_DEBUG_INFO_TEMP_FILE, torch's flight recorder variables as it sets them (a directory becomes the
    prefix <dir>/_dump_, to which torch adds the rank); a variable already in the environment wins. The settings
    Megatron-LM has flags for and angpt does not take its defaults: dump on a timeout, no C++ stacks, only the
    collectives in flight, an extra dump when a rank is asked for one."""
    path = (dump_path or os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
            or os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE"))
    if path is None:
        return
    prefix = os.path.join(path, "_dump_") if os.path.isdir(path) else path
    settings = {"TORCH_FR_DUMP_TEMP_FILE": prefix, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
                "TORCH_NCCL_TRACE_BUFFER_SIZE": str(trace_buffer_size), "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                "TORCH_INCLUDE_STACK_TRACE": "0", "TORCH_INCLUDE_ONLY_ACTIVE": "1",
                "TORCH_NCCL_EXTRA_DUMP_ON_EXEC": "1"}
    rank0 = os.environ.get("RANK", "0") == "0"
    for name, value in settings.items():
        if name in os.environ:
            if rank0 and os.environ[name] != value:
                logger.warning("flight recorder: %s is already set to %r in the environment; %r not used", name,
                               os.environ[name], value)
        else:
            os.environ[name] = value
    if rank0:
        logger.info("flight recorder: %s", " ".join(f"{name}={os.environ[name]}" for name in settings))


def _attempt_store(timeout: timedelta) -> Optional[dist.Store]:
    """The store of a restarted torchrun attempt (`--max-restarts`), under a prefix of its own. torchrun 2.11-2.13
    hands every attempt the agent's store with the keys of the attempts before: the gloo and NCCL groups of a
    restarted group found the dead processes' addresses there and failed ("Connection refused"). None for a
    first attempt, which joins through the environment as usual."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"/angpt/attempt_{restart}", store)


def _default_to_one_process() -> None:
    """Without torchrun, run as the only process of a job on this machine."""
    if "RANK" in os.environ:
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def free_port() -> int:
    """A free TCP port of this machine below the kernel's ephemeral range (ip_local_port_range, 32768-60999 by
    default). A port the kernel hands out there (bind to 0) and that is released before the store binds it can be
    taken meanwhile as the local port of any outgoing connection, such as another job's gloo connections
    (EADDRINUSE)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as file:
            ephemeral = int(file.read().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux
        ephemeral = 32768
    for port in random.Random().sample(range(max(1024, ephemeral - 10000), ephemeral), 100):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port in 100 tries below {ephemeral}")


def set_random_seed(seed: int, cuda_graphs: bool = False) -> None:
    """Megatron-LM's seeding: a different seed per pipeline stage (so stages do not initialize their
    layers alike) and megatron-core's tensor-parallel RNG states, kept in generators that CUDA graphs can
    capture where `cuda_graphs` (megatron-core's local CUDA graphs refuse any other)."""
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    current = getattr(tensor_parallel.get_cuda_rng_tracker(), "use_cudagraphable_rng", False)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=cuda_graphs,
                                                    force_reset_rng=current != cuda_graphs)
