"""Stages 1 and 2: full parameters in the module, gradients reduced in buckets during backward, the optimizer
stepping on this rank's shard of each parameter, updated shards gathered back after the step.

Vocabulary: see :mod:`lightning_zero._engine.layout` (shard, bucket, layouts, presence flags) and
:class:`~lightning_zero._engine.sharded_param.ShardedParam` (a parameter and the shard its optimizer updates).
"""
