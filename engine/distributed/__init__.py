"""Tensor parallelism (`--tensor-parallel-size N`) on torch.distributed.

- `parallel_state`: rendezvous (spawned ranks or torchrun's env vars) and the two groups.
- `sharding`: which heads, features and vocabulary rows each rank holds; cutting a model.
- `layers`: the modules where ranks meet (row-parallel linear, vocab-parallel embedding / LM head).
- `step_message`: the flat int64 message that carries each step to the workers.
- `executor`: rank 0's side (spawn, send steps, watch the workers); `worker`: the others' loop.
"""
