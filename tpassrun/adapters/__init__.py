"""Framework adapters: what Megatron-LM, DeepSpeed and TorchTitan jobs must hand over, and what they must rebuild
after a re-formed world. Import the one you need (each imports its framework lazily)::

    from tpassrun.adapters.megatron import MegatronAdapter      # MegatronAdapter(sess, model, optimizer, scheduler)
    from tpassrun.adapters.deepspeed import DeepSpeedAdapter    # DeepSpeedAdapter(sess, engine, data_loader=...)
    from tpassrun.adapters.torchtitan import TorchTitanAdapter  # TorchTitanAdapter(sess, model_parts, ...)

heavy = sent only when a rank is handed over; light = also snapshotted at every step start (unplanned rollback).

+-------------+-------------------------------------------+---------------------------+--------------------------+
| adapter     | carries                                   | after a swap              | needs a GPU / not tested |
+=============+===========================================+===========================+==========================+
| megatron    | heavy: model chunks (rank-local           | destroy + re-init         | megatron-core 0.16.1 on  |
|             | state_dict), optimizer (+ DistOpt shard   | parallel_state (same      | CPU, TP=2 x DP=2: planned|
|             | via dp_reshardable, no collective),       | TP/PP/CP/EP), re-point    | swap (test_megatron_     |
|             | OptimizerParamScheduler. light: RNG       | groups cached in layers,  | real, GPU-only calls in  |
|             | tracker streams, iteration/consumed       | DDP buckets, optimizer;   | examples/megatron/cpu_   |
|             | samples/flops, data iterator, rerun SM    | mirror get_megatron_      | shims.py); bf16, clip,   |
|             |                                           | optimizer's all_gather    | DistOpt need a GPU       |
+-------------+-------------------------------------------+---------------------------+--------------------------+
| deepspeed   | heavy: module, optimizer (ZeRO-1/2/3:     | repeat the joiner's init  | real DeepSpeed 0.19.8 on |
|             | this rank's partition, ZeRO-3's parameter | collectives: re-create    | CPU: ZeRO 0/1/2 planned, |
|             | partition from its fp32 master, loss      | the engine's groups in    | SIGKILL (ZeRO-0 from a   |
|             | scaler as attributes), lr_scheduler,      | creation order, re-point, | replica, ZeRO-1/2/3 from |
|             | global_steps/samples, skipped/micro       | parameter broadcast(s),   | the shard mirror); ZeRO-3|
|             | steps. light: data loader position        | ZeRO-3 barriers           | offload: torchrun restart|
+-------------+-------------------------------------------+---------------------------+--------------------------+
| torchtitan  | heavy: model parts and optimizer (DTensor | ParallelDims.build_mesh() | real torchtitan 0.3.0 on |
|             | local shards + shard coordinates,         | again (or init_device_    | CPU, 4 ranks: FSDP2      |
|             | re-wrapped on the joiner), LR schedulers. | mesh), re-point FSDP2     | planned swap, HSDP       |
|             | light: dataloader, TrainState             | mesh info, DTensor specs; | SIGKILL from the replica,|
|             |                                           | FSDP2 reset after a       | pure FSDP SIGKILL from   |
|             |                                           | failed step               | the shard mirror         |
+-------------+-------------------------------------------+---------------------------+--------------------------+

Replicas: each adapter declares which ranks hold exactly a rank's state (``sess.declare_replicas``): the donors of
an unplanned recovery (HSDP: the same shard coordinates in the other replica groups; Megatron: the same TP/PP/CP/EP
coordinates in the other data-parallel replicas). Under sharded optimizers (Megatron DistOpt with one instance,
ZeRO >= 1, FSDP without ``dp_replicate``) a rank is alone: planned swaps are exact (the leaver sends), unplanned
ones take its shard from the shard mirror (``sess.track_sharded``) or restart the group, saying why.

Where an adapter must use a framework's private attribute it names the version tested when it is missing
(``TESTED_VERSIONS``; FSDP2's reset: torch 2.13.0).
"""
