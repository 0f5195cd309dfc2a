"""The verifier service: runs the target model, batches requests, streams tokens."""
