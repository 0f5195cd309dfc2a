"""What the services run in common (needs ``specmesh[serve]``): model loading and execution (the
runner, the slot KV cache, attention, packed linears), sampling, the token-tree type, the n-gram
core, gRPC server plumbing, Prometheus metrics and the flag helper.

The verifier and the proposers both import from here and never from each other; the client SDK
(``specmesh`` itself) never imports it.
"""
