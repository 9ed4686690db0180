"""SGLang 0.5.23's own ``GroupCoordinator`` for the "tp" group, built the way SGLang's model
runner builds it with a custom allreduce and nothing else that could take the call (no pynccl,
mscclpp or symmetric-memory allreduce): its custom allreduce is then what tpar's plugin gives
it. Shared by the GPU workers that run SGLang's code (engine_sequence.py --sglang,
sglang_fusion_rank.py); SGLang's sources must be importable."""


def tp_group(world_size: int, local_rank: int):
    from sglang.srt.distributed import parallel_state as ps

    return ps.GroupCoordinator(
        [list(range(world_size))],
        local_rank,
        "nccl",
        use_pynccl=False,
        use_mscclpp=False,
        use_custom_allreduce=True,
        use_torch_symm_mem_all_reduce=False,
        use_hpu_communicator=False,
        use_xpu_communicator=False,
        group_name="tp",
    )
