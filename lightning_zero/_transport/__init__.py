"""How the package's collectives travel: NCCL as it is; on CPU (gloo) through shared memory between the ranks of one
host, or point-to-point exchanges across hosts; ``fully_shard``'s own collectives routed through the same."""
