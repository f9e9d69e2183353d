"""Model parallelism: the tensor-parallel group the layers shard over
(``parallel_state``) and the executor that runs one worker process per rank
(``executor``)."""
