"""OpenAI-compatible HTTP front of SpecMesh: a stateless tier that reaches the verifier only
through the client SDK (gRPC) and holds no model."""
