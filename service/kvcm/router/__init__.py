"""``kvcm router``: one prefix index over many sidecars of one model, and a score per sidecar
for a prompt (docs/router.md).

One module per job:

- ``keyspace``: what makes the block keys and hits of two sidecars comparable (tokens per
  block, layer groups), and the gate that refuses a sidecar of another model;
- ``store``: the index store's contract (cursors, ops, the bit of each sidecar's layer group
  and tier in a block's holder mask);
- ``memory_store`` / ``redis_store`` (+ ``redis_scripts``): the index in this process (the
  default), or in Redis, shared by router replicas and surviving their restarts;
- ``follower``: follows one sidecar (snapshot, then long-polls of ``/v1/events``) into the
  store, and polls its stats;
- ``scorer``: walks a prompt's holder masks into each sidecar's hits;
- ``service``: the followers, the store's upkeep and the route call together;
- ``app`` / ``cli``: the HTTP service and ``kvcm router``.

It imports neither torch nor the manager: a router is a small process.
"""
