"""Triton kernels for the hot paths, each beside its pure-torch ``*_reference()``.

Tree attention and batched tree acceptance land with the kernels issue; until then the
verifier runs the torch paths in ``verifier_svc``.
"""
