"""The device side of a replica: the model runner, the input batch, the KV pool, buckets and compilation."""
