"""The suffix proposer (SuffixDecoding, arXiv 2411.04975): trees of what followed the context's
suffix, in this request and in the outputs of past requests, scored by frequency.

Two sources per request (``request.SuffixRequest``):

- **the request's own context** (prompt + accepted tokens), a ``buffer.TokenBuffer`` searched by
  its bigram hash chains;
- **the global cache** of one scope (``cache.ScopeCache``): the outputs of recent requests with the
  same ``cache_scope``, finished ones in a truncated suffix array (``index.SealedIndex``) rebuilt
  in a background thread, the newest in an unindexed tail, running ones where they are; bounded
  by tokens with FIFO eviction by request (``cache.SuffixCache``).

Each source proposes its best tree (``trees.best_tree``, built by the proposers' shared
``proposer_svc.core.continuation_trie``), their union is sent (``trees.union``), and each node's
count ratio is replaced by the acceptance measured for nodes like it (``calibration``). The
service is ``server``; ``share`` passes finished outputs between replicas through Redis.
"""
