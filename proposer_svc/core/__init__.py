"""What every proposer service runs: the Propose stream framework and the process wiring."""
