"""The draft-model proposer: the batched draft, its service and distillation."""
