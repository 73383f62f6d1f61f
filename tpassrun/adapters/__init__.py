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
| deepspeed   | heavy: module, optimizer (ZeRO-1/2: this  | re-create the engine's    | not run against real     |
|             | rank's partition, fp32 master exact),     | groups (same members) and | DeepSpeed (heavy install)|
|             | lr_scheduler, global_steps/samples,       | re-point references,      | stand-ins only; ZeRO-3   |
|             | skipped/micro steps. light: data loader   | incl. deepspeed.utils.    | refused                  |
|             |                                           | groups globals            |                          |
+-------------+-------------------------------------------+---------------------------+--------------------------+
| torchtitan  | heavy: model parts and optimizer (DTensor | init_device_mesh (same    | torchtitan itself not    |
|             | local shards, re-wrapped on the joiner),  | shape/names), re-point    | installed; FSDP2 state + |
|             | LR schedulers. light: dataloader,         | FSDP2 mesh info, groups,  | mesh rebuild tested on a |
|             | TrainState                                | DTensor specs             | 1-process CPU world      |
+-------------+-------------------------------------------+---------------------------+--------------------------+

Replicas: each adapter has ``replicated`` (is there a live peer holding everything this rank holds?). Under
sharded optimizers (Megatron DistOpt with one instance, ZeRO >= 1, FSDP without ``dp_replicate``) it is False:
planned swaps are exact (the leaver sends), unplanned ones have no donor. For Megatron, a donor must have the same
model-parallel coordinates: :func:`tpassrun.adapters.megatron.donor_rank`.
"""
