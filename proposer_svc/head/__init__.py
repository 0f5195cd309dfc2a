"""The learned-head proposer: the head and its batched trees, its service and training."""
