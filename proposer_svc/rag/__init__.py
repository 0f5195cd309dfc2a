"""The RAG proposer: the datastore, the lookup, its service and the upload CLI."""
