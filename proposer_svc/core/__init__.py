"""What the proposers share: the Propose stream framework, the process wiring, the weighted continuation
trie (suffix, RAG), the batched tree search with its flags and event thread (draft, head), and the
training data and flags of the training tools."""
