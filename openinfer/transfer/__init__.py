"""Bytes that move: the host tier's pool, the file store, and the KV-transfer server and
connectors of disaggregated prefill/decode. Owned by the worker that owns the KV tensors;
the decisions (what to copy where) are made in pure Python by openinfer/kv/."""
