"""Build the GPT model chunks: megatron-core GPTModel, Float16Module for bf16/fp16, megatron DDP.

GPT-2 style by default; the Llama family's parts (rotary embeddings, RMSNorm, SwiGLU, grouped-query
attention, no biases) are megatron-core's own modules, selected through TransformerConfig fields
and GPTModel arguments as Megatron-LM does.
"""
from __future__ import annotations

import zlib
from contextlib import contextmanager
from typing import List

import torch

from megatron.training.config import ModelConfig, ParallelConfig
from megatron.training.cpu_compat import cuda_available
from megatron.training.mcore_fixes import batch_p2p_comm_for


def params_dtype(model: ModelConfig) -> torch.dtype:
    return torch.bfloat16 if model.bf16 else torch.float16 if model.fp16 else torch.float32


def transformer_config(model: ModelConfig, parallel: ParallelConfig, backend: str):
    """megatron-core TransformerConfig for our model and layout."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = params_dtype(model)
    recompute = {"recompute_granularity": None if model.recompute_granularity is None
                 else model.recompute_granularity.value,
                 "recompute_method": None if model.recompute_method is None
                 else model.recompute_method.value,
                 "recompute_num_layers": model.recompute_num_layers}
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        ffn_hidden_size=model.ffn_hidden_size,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        init_method_std=model.init_method_std,
        normalization=model.normalization.value,
        layernorm_epsilon=model.norm_epsilon,
        layernorm_zero_centered_gamma=model.apply_layernorm_1p,
        # Megatron-LM's --swiglu: a gated MLP with SiLU; the fc1 output holds both halves.
        gated_linear_unit=model.swiglu,
        activation_func=F.silu if model.swiglu else F.gelu,
        num_query_groups=model.num_query_groups,
        add_bias_linear=model.add_bias_linear,
        **recompute,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage=parallel.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=parallel.decoder_last_pipeline_num_layers,
        sequence_parallel=parallel.sequence_parallel,
        # The schedules allocate p2p receive buffers of this dtype.
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=model.bf16,
        fp16=model.fp16,
        # On CPU this makes initial weights identical for any TP size (full master weight, then
        # split); on GPU it is Megatron's default (initialise on device).
        use_cpu_initialization=not cuda_available(),
        batch_p2p_comm=batch_p2p_comm_for(parallel.pipeline_model_parallel_size,
                                          parallel.virtual_pipeline_model_parallel_size, backend),
        calculate_per_token_loss=model.calculate_per_token_loss,
        attention_backend=_attention_backend(model),
        cross_entropy_loss_fusion=model.cross_entropy_fusion is not None,
        cross_entropy_fusion_impl=model.cross_entropy_fusion or "native",
    )


def layer_spec(model: ModelConfig):
    """transformer-engine spec when CUDA and TE are importable; the local (torch) spec otherwise.
    (TE's norm follows config.normalization; the local spec is told RMSNorm explicitly.)"""
    from megatron.core.models.gpt import gpt_layer_specs

    if cuda_available() and model.attention_backend != "local":  # local: as Megatron-LM's
        try:                                                      # --spec local
            import transformer_engine  # noqa: F401

            return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
        except ImportError:
            pass
    return gpt_layer_specs.get_gpt_layer_local_spec(normalization=model.normalization.value)


#: transformer-engine's attention switches, which megatron-core's model constructor sets in
#: os.environ for the model's --attention-backend, asserting that values already there agree.
ATTENTION_SWITCHES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


def _attention_backend(model: ModelConfig):
    """megatron-core's AttnBackend for --attention-backend (it sets transformer-engine's NVTE_*
    switches when the model is built)."""
    from megatron.core.transformer.enums import AttnBackend

    return AttnBackend[model.attention_backend]


def gpt_model_args(model: ModelConfig) -> dict:
    """The GPTModel arguments that describe the architecture (the layout ones apart)."""
    return dict(transformer_layer_spec=layer_spec(model), vocab_size=model.padded_vocab_size,
                max_sequence_length=model.max_position_embeddings,
                share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
                position_embedding_type=model.position_embedding_type.value,
                rotary_percent=model.rotary_percent, rotary_base=model.rotary_base)


def build_model_chunks(model: ModelConfig, parallel: ParallelConfig, config) -> List[torch.nn.Module]:
    """One GPTModel per virtual pipeline stage held by this rank (one without VPP)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    vpp = parallel.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp is not None else None
        chunks.append(GPTModel(
            config=config,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            parallel_output=True,
            vp_stage=stage,
            **gpt_model_args(model),
        ))
    return chunks


def leaf_sharded_tensors(sharded_state_dict):
    """Every ShardedTensor of a megatron sharded state dict, with each ShardedTensorFactory
    (swiglu's fc1: one local tensor, two global row ranges) replaced by the ShardedTensors it
    builds, whose data are views of the factory's tensor."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for sh in nested_values(sharded_state_dict):
        if isinstance(sh, ShardedTensorFactory):
            yield from leaf_sharded_tensors(sh.build())
        elif isinstance(sh, ShardedTensor):
            yield sh


def _seed_for(seed: int, key: str, index: tuple) -> int:
    return (seed * 1_000_003 + zlib.crc32(f"{key}@{index}".encode())) % (2**63 - 1)


@torch.no_grad()
def initialize_weights_layout_independent(chunks, model: ModelConfig, seed: int) -> int:
    """Re-draw every weight matrix from a generator keyed by (seed, global name, layer), slicing
    this rank's shard out of the full tensor.

    Megatron's own initialisation consumes one RNG stream in construction order and offsets the
    seed per pipeline stage, so a PP run starts from other weights than a single-process run.
    Keyed draws make the initial model a function of the seed alone, identical for any TP/PP/VPP/DP
    layout. Biases and norms are constants already. Returns the number of pieces re-drawn (a
    swiglu fc1 weight counts twice: its two halves sit at different rows of the global tensor).
    """
    std = model.init_method_std
    scaled_std = std / (2.0 * model.num_layers) ** 0.5  # Megatron's scaled_init_method_normal
    count = 0
    for chunk in chunks:
        for sh in leaf_sharded_tensors(chunk.sharded_state_dict()):
            if sh.key.endswith("_extra_state"):
                continue
            pre = sh.prepend_axis_num
            if sh.data.dim() < 2 or len(sh.global_shape) - pre < 2:
                continue
            name = sh.key
            sigma = scaled_std if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else std
            outer = tuple(sh.global_offset[:pre])
            gen = torch.Generator().manual_seed(_seed_for(seed, name, outer))
            full = torch.empty(sh.global_shape[pre:], dtype=torch.float32)
            full.normal_(0.0, sigma, generator=gen)
            index = tuple(slice(o, o + n) for o, n in zip(sh.global_offset[pre:], sh.data.shape))
            sh.data.copy_(full[index].to(sh.data.dtype))
            count += 1
    return count


def wrap_model(chunks, model: ModelConfig, parallel: ParallelConfig, config):
    """Float16Module for bf16/fp16 (as Megatron does; it also casts norms) and megatron DDP,
    which megatron's optimizer needs even at DP=1."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    if cuda_available():
        chunks = [c.cuda(torch.cuda.current_device()) for c in chunks]
    if model.bf16 or model.fp16:
        chunks = [Float16Module(config, c) for c in chunks]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=model.bf16 and not parallel.grad_reduce_in_bf16,
        use_distributed_optimizer=parallel.use_distributed_optimizer,
        overlap_grad_reduce=parallel.overlap_grad_reduce,
        overlap_param_gather=parallel.overlap_param_gather,
        # Megatron-LM's default (--no-align-param-gather is not taken): with a pipeline, every
        # stage's first all-gather is dispatched by the schedule (`param_sync_func`).
        align_param_gather=parallel.overlap_param_gather,
        bucket_size=parallel.ddp_bucket_size,
    )
    return [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=c,
                                disable_bucketing=(i > 0))
        for i, c in enumerate(chunks)
    ]


@contextmanager
def params_gathered(chunks, parallel: ParallelConfig):
    """With --overlap-param-gather the optimizer step leaves the all-gather of the updated
    parameters to the next forward pass (each module's pre-hook waits for its bucket). A
    checkpoint or a validation needs them now: as Megatron-LM does around its saves and
    evaluations, the pre-hooks are taken off, which all-gathers every bucket synchronously, and
    put back after. A lazy snapshot copied during the next forward/backward then reads what was
    gathered here: nothing writes the parameters again before the next optimizer step (a pre-hook
    that gathers again writes the same values)."""
    if not parallel.overlap_param_gather:
        yield
        return
    for chunk in chunks:
        chunk.disable_forward_pre_hook(param_sync=True)
    try:
        yield
    finally:
        for chunk in chunks:
            chunk.enable_forward_pre_hook()


def unwrap(chunk):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def count_parameters(chunks) -> int:
    return sum(p.numel() for c in chunks for p in c.parameters())
