"""Framework adapters: what Megatron-LM, DeepSpeed and TorchTitan jobs must hand over, and what they must rebuild
after a re-formed world. Import the one you need (each imports its framework lazily)::

    from tpassrun.adapters.megatron import MegatronAdapter      # MegatronAdapter(sess, model, optimizer, scheduler)
    from tpassrun.adapters.deepspeed import DeepSpeedAdapter    # DeepSpeedAdapter(sess, engine, data_loader=...)
    from tpassrun.adapters.torchtitan import TorchTitanAdapter  # TorchTitanAdapter(sess, model_parts, ...)

heavy = sent only when a rank is handed over; light = also snapshotted at every step start (unplanned rollback).

+-------------+-------------------------------------------+---------------------------+--------------------------+
| adapter     | carries                                   | after a swap              | needs a GPU / not tested |
+=============+===========================================+===========================+==========================+
| megatron    | heavy: model chunks (rank-local           | destroy + re-init         | DistributedOptimizer     |
|             | state_dict), optimizer (+ DistOpt shard   | parallel_state (same      | shard path and training  |
|             | via dp_reshardable, no collective),       | TP/PP/CP/EP), re-point    | steps need CUDA; tested: |
|             | OptimizerParamScheduler. light: RNG       | groups cached in layers,  | parallel_state re-init + |
|             | tracker streams, iteration/consumed       | DDP buckets, optimizer    | GPTModel state on CPU    |
|             | samples/flops, data iterator, rerun SM    |                           | (megatron-core 0.16.1)   |
+-------------+-------------------------------------------+---------------------------+--------------------------+
| deepspeed   | heavy: module, optimizer (ZeRO-1/2: this  | repeat the joiner's init  | real DeepSpeed 0.19.8 on |
|             | rank's partition, fp32 master exact, loss | collectives: re-create    | CPU: ZeRO 0/1/2 planned, |
|             | scaler as attributes), lr_scheduler,      | the engine's groups in    | ZeRO-0 SIGKILL (tests/   |
|             | global_steps/samples, skipped/micro       | creation order, re-point, | test_deepspeed_real.py); |
|             | steps. light: data loader position        | parameter broadcast       | ZeRO-3 refused           |
+-------------+-------------------------------------------+---------------------------+--------------------------+
| torchtitan  | heavy: model parts and optimizer (DTensor | ParallelDims.build_mesh() | real torchtitan 0.3.0 on |
|             | local shards + shard coordinates,         | again (or init_device_    | CPU, 4 ranks: FSDP2      |
|             | re-wrapped on the joiner), LR schedulers. | mesh), re-point FSDP2     | planned swap (test_      |
|             | light: dataloader, TrainState             | mesh info, DTensor specs  | torchtitan_real)         |
+-------------+-------------------------------------------+---------------------------+--------------------------+

Replicas: each adapter has ``replicated`` (is there a live peer holding everything this rank holds?). Under
sharded optimizers (Megatron DistOpt with one instance, ZeRO >= 1, FSDP without ``dp_replicate``) it is False:
planned swaps are exact (the leaver sends), unplanned ones have no donor. For Megatron, a donor must have the same
model-parallel coordinates: :func:`tpassrun.adapters.megatron.donor_rank`.
"""
