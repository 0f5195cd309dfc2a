"""The n-gram proposer service; its core, shared with the verifier's in-process n-gram, is ``specmesh_server.ngram``."""
